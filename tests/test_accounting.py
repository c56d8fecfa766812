"""Bytes that hoplite moves show in Dask's own bookkeeping, as Dask's own
fetches do: the transfer logs and totals on both ends, the bandwidth
estimate, the Task Stream's transfer bars and the fine performance metrics."""

from __future__ import annotations

from time import time

import numpy as np
import pytest
from distributed import Client, Scheduler, Worker, wait
from distributed.utils_test import gen_cluster, gen_test

import dask_hoplite as dh
from dask_hoplite import Hoplite
from dask_hoplite.compat import worker_addresses

MiB = 2**20


def received_bytes(worker, key):
    return sum(e["keys"].get(key, 0) for e in worker.transfer_incoming_log)


def sent_bytes(worker, key):
    return sum(e["keys"].get(key, 0) for e in worker.transfer_outgoing_log)


@gen_cluster(client=True, nthreads=[("", 1)] * 4)
async def test_a_broadcast_is_in_the_transfer_logs_and_task_stream_of_every_receiver(
    c, s, *workers
):
    await c.register_plugin(Hoplite())
    src, *receivers = workers
    x = c.submit(np.ones, 4 * MiB, dtype="f8", key="x", workers=[src.address])  # 32 MiB
    await wait(x)
    bandwidth_before = [w.bandwidth for w in receivers]
    await c.get_task_stream(start=0, stop=0)  # start the Task Stream's plugin
    t0 = time()
    copies = await dh.broadcast(x, [w.address for w in receivers])
    await wait(copies)
    task_stream = await c.get_task_stream(start=t0)

    for w in receivers:
        assert w.plugins["hoplite-worker"].stats.get("keys-received") == 1  # through hoplite
        # The receiver's log counts the key's 32 MiB, from its hoplite sender.
        assert received_bytes(w, x.key) == 32 * MiB
        (entry,) = [e for e in w.transfer_incoming_log if x.key in e["keys"]]
        assert entry["who"] in {v.address for v in workers} - {w.address}
        assert entry["total"] == 32 * MiB and entry["bandwidth"] > 0
        assert entry["hoplite"] is True  # told apart from Dask's own fetches
    # Dask's bandwidth estimate learnt from those transfers.
    assert [w.bandwidth for w in receivers] != bandwidth_before

    # Every byte sent is on some sender's outgoing log and totals: one copy per receiver.
    assert sum(sent_bytes(w, x.key) for w in workers) == 3 * 32 * MiB
    assert sum(w.transfer_outgoing_bytes_total for w in workers) == 3 * 32 * MiB
    assert sum(w.transfer_outgoing_count_total for w in workers) == 3
    assert all(w.transfer_outgoing_count == 0 and w.transfer_outgoing_bytes == 0 for w in workers)
    for w in workers:
        for e in w.transfer_outgoing_log:
            assert e["who"] in {r.address for r in receivers}  # a worker, not a port

    # The Task Stream: each copy's task has a transfer bar from its sender.
    senders = {
        w.address: next(e["who"] for e in w.transfer_incoming_log if x.key in e["keys"])
        for w in receivers
    }
    bars = {
        rec["worker"]: [ss for ss in rec["startstops"] if ss["action"] == "transfer"]
        for rec in task_stream
        if rec["key"] in {f.key for f in copies}
    }
    assert set(bars) == set(senders)
    for addr, transfers in bars.items():
        assert [t["source"] for t in transfers] == [senders[addr]]
        assert transfers[0]["stop"] >= transfers[0]["start"]
    # The worker's story of the key says what came from whom, as for Dask's fetches.
    for w in receivers:
        received = [ev[:3] for ev in w.state.story(x.key) if ev[0] == "receive-dep"]
        assert received == [("receive-dep", senders[w.address], {x.key})]


@gen_cluster(client=True, nthreads=[("", 1)] * 3)
async def test_hoplite_streams_are_in_the_fine_performance_metrics(c, s, a, b, d):
    await c.register_plugin(Hoplite())
    x = c.submit(np.ones, MiB, dtype="f8", key="x", workers=[a.address])
    await wait(x)
    await wait(await dh.broadcast(x, [b.address, d.address]))
    for w in (b, d):
        # The receiver's gather-dep time, as network and deserialisation.
        labels = {k[1:] for k in w.digests_total if isinstance(k, tuple) and k[0] == "gather-dep"}
        assert ("network", "seconds") in labels
        assert ("deserialize", "seconds") in labels
    # The senders' side, under get-data as for Dask's own sends.
    sent = {
        k[1:]
        for w in (a, b, d)
        for k in w.digests_total
        if isinstance(k, tuple) and k[0] == "get-data"
    }
    assert ("network", "seconds") in sent


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 4,
    scheduler_kwargs={"dashboard": True},
    worker_kwargs={"dashboard": True},
)
async def test_a_broadcast_is_on_the_metrics_pages_of_scheduler_and_workers(c, s, *workers):
    pytest.importorskip("prometheus_client")
    from distributed.utils_test import fetch_metrics

    await c.register_plugin(Hoplite())
    src, *receivers = workers
    x = c.submit(np.ones, 4 * MiB, dtype="f8", key="x", workers=[src.address])  # 32 MiB
    await wait(x)
    await wait(await dh.broadcast(x, [w.address for w in receivers]))

    series = await fetch_metrics(s.http_server.port, prefix="dask_hoplite_")

    def mine(family, **labels):
        """The counter's value for this scheduler (and ``labels``)."""
        return {
            x.value
            for x in series[family].samples
            if x.name.endswith("_total")
            and x.labels["scheduler"] == s.address
            and labels.items() <= x.labels.items()
        }

    assert mine("dask_hoplite_scheduler_bytes_streamed") == {3 * 32 * MiB}
    assert mine("dask_hoplite_scheduler_transfers", outcome="ok") == {3}
    (entries,) = [
        x.value
        for x in series["dask_hoplite_scheduler_directory_entries"].samples
        if x.labels["scheduler"] == s.address
    ]
    assert entries >= 1

    received = sent = 0.0
    for w in workers:
        series = await fetch_metrics(w.http_server.port, prefix="dask_hoplite_worker_")
        # Workers of one process share a registry: each one's page has every
        # worker's series, labelled by address.
        for sample in series["dask_hoplite_worker_bytes_received"].samples:
            if sample.labels["worker"] == w.address and sample.name.endswith("_total"):
                received += sample.value
        for sample in series["dask_hoplite_worker_bytes_sent"].samples:
            if sample.labels["worker"] == w.address and sample.name.endswith("_total"):
                sent += sample.value
        pool = {x.labels["state"] for x in series["dask_hoplite_worker_buffer_pool_bytes"].samples}
        assert pool == {"idle", "in_use"}
    assert received == sent == 3 * 32 * MiB


@gen_test()
async def test_the_series_go_when_the_plugin_stops():
    prometheus_client = pytest.importorskip("prometheus_client")

    def labelled(address):
        """Whether this process exports a hoplite series labelled ``address``."""
        text = prometheus_client.generate_latest().decode()
        return any(
            line.startswith("dask_hoplite_") and f'"{address}"' in line
            for line in text.splitlines()
        )

    async with (
        Scheduler(dashboard_address=":0", dashboard=True) as s,
        Worker(s.address, dashboard=True) as a,
        Client(s.address, asynchronous=True) as c,
    ):
        await c.register_plugin(Hoplite())
        assert labelled(a.address) and labelled(s.address)
        await c.unregister_worker_plugin("hoplite-worker")
        assert not labelled(a.address) and labelled(s.address)
        address = s.address
    assert not labelled(address)  # the scheduler closed: its plugin stopped


def test_a_reduce_tree_is_in_the_transfer_logs(client):
    """Dask alone would log every part into one worker; a reduce tree logs
    each edge: the partial results each worker received and sent."""

    def totals(dask_worker):
        incoming = sum(e["total"] for e in dask_worker.transfer_incoming_log)
        return incoming, dask_worker.transfer_outgoing_bytes_total

    before = client.run(totals)
    ws = worker_addresses(client)
    parts = [
        client.submit(np.full, MiB // 8, float(i), workers=[ws[i % 3]], pure=False)
        for i in range(6)
    ]
    total = dh.reduce(parts, op="sum")
    assert float(total.result().sum()) == sum(range(6)) * (MiB // 8)
    after = client.run(totals)
    received = sum(after[w][0] - before[w][0] for w in ws)
    sent = sum(after[w][1] - before[w][1] for w in ws)
    # Three workers, each with two inputs: at least two MiB-sized partial
    # results cross the network, on both ends' records.
    assert received >= 2 * MiB and sent >= 2 * MiB
