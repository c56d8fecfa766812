"""Broadcast through hoplite on real in-process clusters (gen_cluster):
identical results for every kind of object, the directory's tree, fallbacks,
replicate / scatter, AMM cooperation and cleanup."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
from distributed import Event, Worker, wait
from distributed.utils import wait_for
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.core.protocol import STREAM_OP

SMALL = {
    # Small thresholds so that tests move many objects quickly.
    "hoplite.min-bytes": "64 KiB",
    "hoplite.min-block-bytes": "4 KiB",
    "hoplite.block-bytes": "64 KiB",
    "hoplite.window-bytes": "256 KiB",
}


def stats(workers, name):
    return [w.plugins["hoplite-worker"].stats.get(name, 0) for w in workers]


def identity(x, i=0):
    return x


def checksum(x, i=0):
    return float(np.asarray(x).sum())


@gen_cluster(client=True, nthreads=[("", 1)] * 4, config=SMALL)
async def test_simultaneous_consumers_form_a_chain_with_identical_results(c, s, *workers):
    await c.register_plugin(Hoplite())
    src, *others = workers
    x = c.submit(np.random.default_rng(0).random, 200_000, workers=[src.address])
    await wait(x)
    futs = [c.submit(checksum, x, i, workers=[w.address], pure=False) for i, w in enumerate(others)]
    got = await c.gather(futs)
    assert got == [float(np.random.default_rng(0).random(200_000).sum())] * 3
    assert stats(others, "keys-received") == [1, 1, 1]
    info = await c.scheduler.hoplite_info()
    (entry,) = [e for e in info["keys"] if e["key"] == x.key]
    assert entry["peak_uploads"] == 1  # fanout 1: nobody served two streams at once
    senders = [a for a, _ in entry["edges"]]
    receivers = [b for _, b in entry["edges"]]
    assert sorted(receivers) == sorted(w.address for w in others)
    assert senders.count(src.address) == 1  # a chain, not a star


OBJECTS = {
    "zero-size": np.zeros(0),
    "just-under-min-bytes": np.ones(64 * 1024 - 1, dtype="u1"),
    "just-over-min-bytes": np.arange(64 * 1024 + 1, dtype="u1"),
    "not-a-multiple-of-the-block": np.arange(100_003, dtype="f8"),
    "non-contiguous": np.arange(400_000, dtype="i4").reshape(400, 1000)[::2, ::3],
    "fortran-ordered": np.asfortranarray(np.arange(200_000, dtype="f4").reshape(400, 500)),
    "structured": np.array(
        [(i, i * 0.5, b"ab") for i in range(20_000)],
        dtype=[("a", "i8"), ("b", "f8"), ("c", "S2")],
    ),
    "object-array": np.array([f"s{i}" * 3 for i in range(20_000)], dtype=object),
    "dict-of-bytes": {"payload": b"x" * 300_000, "n": 3},
    "list-of-arrays": [np.arange(50_000), np.ones((100, 300))],
    "bytes": bytes(range(256)) * 1000,
    **{
        f"dtype-{dt}": (np.arange(100_000) % 100).astype(dt)
        for dt in [
            "i1",
            "i2",
            "i4",
            "i8",
            "u1",
            "u2",
            "u4",
            "u8",
            "f2",
            "f4",
            "f8",
            "c8",
            "c16",
            "?",
        ]
    },
}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b)
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_every_kind_of_object_arrives_identical(c, s, a, b, d):
    await c.register_plugin(Hoplite())
    names = list(OBJECTS)
    sources = await c.scatter([OBJECTS[n] for n in names], workers=[a.address])
    outs = [c.submit(identity, f, 1, workers=[b.address], pure=False) for f in sources]
    outs2 = [c.submit(identity, f, 2, workers=[d.address], pure=False) for f in sources]
    got = await c.gather(outs + outs2)
    for i, name in enumerate(names):
        assert _same(OBJECTS[name], got[i]), name
        assert _same(OBJECTS[name], got[len(names) + i]), name
    # Large objects went through hoplite, the small ones through Dask.
    nlarge = sum(1 for n in names if s.tasks[sources[names.index(n)].key].nbytes >= 64 * 1024)
    assert nlarge >= len(names) - 3
    allstats = [w.plugins["hoplite-worker"].stats for w in (a, b, d)]
    assert sum(stats([b, d], "keys-received")) == 2 * nlarge, allstats


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_sender_refusal_falls_back_to_dask(c, s, a, b, d):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 100_000, workers=[a.address])
    await wait(x)

    async def refuse(comm, **msg):
        await comm.write({"status": "error", "message": "refused for the test"})
        from distributed.core import Status

        return Status.dont_reply

    a.handlers[STREAM_OP] = refuse
    y = c.submit(checksum, x, workers=[b.address])
    assert await y == float(np.arange(100_000).sum())
    assert stats([b], "streams-failed") == [1]
    # The directory was told: no stream is left open.
    info = await c.scheduler.hoplite_info()
    assert info["transfers"] == 0


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_registering_twice_installs_once_and_keeps_working(c, s, a, b):
    await c.register_plugin(Hoplite())
    first = s.handlers["hoplite_request"]
    await c.register_plugin(Hoplite())
    assert s.handlers["hoplite_request"] != first  # the new instance took over
    assert [p for p in s.plugins.values() if isinstance(p, Hoplite)].__len__() == 1
    # the original replicate was restored before re-wrapping, not wrapped twice
    assert s.handlers["replicate"].__self__ is s.plugins["hoplite"].replicator
    assert s.plugins["hoplite"].replicator.original.__self__ is s
    x = c.submit(np.arange, 100_000, workers=[a.address])
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())
    assert stats([b], "keys-received") == [1]


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_worker_joining_later_gets_the_worker_part(c, s, a, b):
    await c.register_plugin(Hoplite())
    async with Worker(s.address, nthreads=1) as w:
        assert "hoplite-worker" in w.plugins
        assert w.gather_dep == w.plugins["hoplite-worker"].gather_dep
        x = c.submit(np.arange, 100_000, workers=[a.address])
        assert await c.submit(checksum, x, workers=[w.address]) == float(np.arange(100_000).sum())
        assert stats([w], "keys-received") == [1]


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_teardown_restores_dask(c, s, a, b):
    await c.register_plugin(Hoplite())
    await c.unregister_worker_plugin("hoplite-worker")
    for w in (a, b):
        assert "gather_dep" not in w.__dict__
        assert STREAM_OP not in w.handlers
    x = c.submit(np.arange, 100_000, workers=[a.address])
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 4,
    config={
        **SMALL,
        "distributed.scheduler.active-memory-manager.start": True,
        "distributed.scheduler.active-memory-manager.interval": "20ms",
    },
)
async def test_replicate_and_scatter_broadcast_complete_with_the_amm_on(c, s, *workers):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 300_000, workers=[workers[0].address])
    await wait(x)
    await wait_for(c.replicate([x]), 60)
    assert sum(stats(workers[1:], "keys-received")) == 3
    [y] = await wait_for(c.scatter([np.ones(300_000)], broadcast=True), 60)
    assert sum(stats(workers, "keys-received")) == 6
    assert await c.submit(checksum, y) == 300_000.0


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_amm_does_not_drop_replicas_under_an_active_stream(c, s, a, b, d):
    await c.register_plugin(Hoplite())
    plugin = s.plugins["hoplite"]
    amm = s.extensions["amm"]
    for i, holder in enumerate([a, b, a, b]):
        # Small enough for Dask's own replicate: the directory knows only the
        # holders we tell it about.
        x = c.submit(np.full, 5_000, i, workers=[a.address], pure=False)
        await wait(x)
        await c.replicate([x], n=2, workers=[a.address, b.address])
        ts = s.tasks[x.key]
        assert len(ts.who_has) == 2
        # d starts streaming from one of the two holders (each in turn, so
        # that the AMM's own preference cannot make this pass by chance)...
        decision = plugin.directory.request(x.key, d.address, [holder.address])
        sender = s.workers[decision.sender]
        assert sender.address == holder.address
        # ...and the AMM, which wants one replica only, drops the other one.
        amm.run_once()
        while len(ts.who_has) > 1:
            await asyncio.sleep(0.01)
        assert ts.who_has == {sender}
        plugin.directory.transfer_finished(decision.transfer_id, ok=False)
        del x


def gated_checksum(x, gate):
    Event(gate).wait()
    return checksum(x)


async def _replicas_while_a_task_waits(c, s, a, b, d) -> tuple[int, int]:
    """x on a, fetched by a task on b (done) and one on d (held on an event):
    how many replicas the AMM leaves while d's task waits, and after."""
    await c.register_plugin(Hoplite())
    amm = s.extensions["amm"]
    x = c.submit(np.full, 100_000, 1.0, workers=[a.address])
    await wait(x)
    assert await c.submit(checksum, x, workers=[b.address]) == 100_000.0
    waiting = c.submit(gated_checksum, x, "gate", workers=[d.address])
    ts = s.tasks[x.key]
    while len(ts.who_has) < 3:
        await asyncio.sleep(0.01)
    for _ in range(3):  # b's task is done: to Dask, b's copy is surplus now
        amm.run_once()
        await asyncio.sleep(0.05)
    during = len(ts.who_has)
    await Event("gate", client=c).set()
    assert await waiting == 100_000.0
    amm.run_once()
    for _ in range(200):  # nothing needs x now: the AMM reclaims as usual
        if len(ts.who_has) == 1:
            break
        await asyncio.sleep(0.01)
        amm.run_once()
    return during, len(ts.who_has)


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_the_amm_keeps_every_replica_of_a_large_key_while_a_task_needs_it(c, s, a, b, d):
    """A stolen task landing on b then finds x there, instead of fetching the
    whole object again."""
    assert await _replicas_while_a_task_waits(c, s, a, b, d) == (3, 1)


@gen_cluster(
    client=True, nthreads=[("", 1)] * 3, config={**SMALL, "hoplite.amm.keep-while-needed": False}
)
async def test_without_keep_while_needed_the_amm_drops_the_copies_no_waiting_task_is_on(
    c, s, a, b, d
):
    """The counterpart: Dask's own policy keeps a copy where a task waits."""
    during, after = await _replicas_while_a_task_waits(c, s, a, b, d)
    assert during < 3 and after == 1


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_released_keys_leave_no_buffers_or_directory_entries(c, s, a, b, d):
    await c.register_plugin(Hoplite())
    for i in range(20):
        x = c.submit(np.full, 100_000, i, workers=[a.address], pure=False)
        ys = [
            c.submit(checksum, x, j, workers=[w.address], pure=False) for j, w in enumerate((b, d))
        ]
        assert await c.gather(ys) == [100_000.0 * i] * 2
        del x, ys
    while s.tasks:
        await asyncio.sleep(0.01)
    for _ in range(200):
        info = await c.scheduler.hoplite_info()
        bufs = [len(w.plugins["hoplite-worker"].store) for w in (a, b, d)]
        if info["objects"] == 0 and bufs == [0, 0, 0]:
            break
        await asyncio.sleep(0.02)
    assert info["objects"] == 0 and info["transfers"] == 0 and info["waiting"] == 0
    assert bufs == [0, 0, 0]
    assert sum(stats([b, d], "keys-received")) == 40


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_a_key_a_task_fetches_for_itself_leaves_no_buffer(c, s, a, b):
    """Found by the chaos test: a reduction's result task rerun away from its
    root fetched the root's input itself, through hoplite, into a buffer that
    no Dask transition on that worker would ever release."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.full, 100_000, 3.0, workers=[a.address], pure=False)
    await wait(x)
    receiver = b.plugins["hoplite-worker"].parts.receiver
    [value] = await receiver.fetch_parts([x.key], {x.key: [a.address]})
    assert float(value.sum()) == 300_000.0
    assert b.plugins["hoplite-worker"].stats["keys-received"] == 1  # it came through hoplite
    assert x.key not in b.state.tasks  # Dask does not know b has it
    for _ in range(200):
        info = await c.scheduler.hoplite_info()
        if len(b.plugins["hoplite-worker"].store) == 0 and info["objects"] <= 1:
            break
        await asyncio.sleep(0.02)
    assert len(b.plugins["hoplite-worker"].store) == 0
    del x
    while s.tasks:
        await asyncio.sleep(0.01)
    for _ in range(200):
        info = await c.scheduler.hoplite_info()
        if info["objects"] == 0:
            break
        await asyncio.sleep(0.02)
    assert info["objects"] == 0


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_a_received_buffer_can_be_deserialised_again_and_served_on(c, s, a, b):
    """Dask's deserialize mutates collection headers; a relay deserialises its
    copy and then serves the same layout to others."""
    await c.register_plugin(Hoplite())
    obj = {"payload": b"x" * 300_000, "n": 3, "arr": np.arange(10_000)}
    [x] = await c.scatter([obj], workers=[a.address])
    got = await c.submit(identity, x, workers=[b.address])
    plugin = b.plugins["hoplite-worker"]
    assert plugin.stats["keys-received"] == 1
    for _ in range(2):  # served from b's own buffer, twice
        ok, again = await plugin.parts.receiver.fetch(x.key)
        assert ok and _same(obj, again)
    assert plugin.stats["local-hits"] == 2
    assert _same(obj, got)


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 2,
    config=SMALL,
    scheduler_kwargs={"preload": ["dask_hoplite"]},
)
async def test_scheduler_preload_installs_everything(c, s, a, b):
    """`dask scheduler --preload dask_hoplite`: no registration call needed."""
    assert isinstance(s.plugins.get("hoplite"), Hoplite)
    for w in (a, b):
        assert w.gather_dep == w.plugins["hoplite-worker"].gather_dep
    x = c.submit(np.arange, 100_000, workers=[a.address])
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())
    assert stats([b], "keys-received") == [1]


@gen_cluster(
    client=True,
    nthreads=[(f"127.0.0.{i}", 1) for i in range(1, 8)],
    config=SMALL,
    timeout=60,
)
async def test_a_broadcast_in_parts_sends_each_part_down_its_own_tree(c, s, *workers):
    import dask_hoplite as dh
    from dask_hoplite.core.split_trees import tree_depth

    await c.register_plugin(Hoplite())
    directory = s.plugins["hoplite"].directory
    edges: list[tuple[str, str, str]] = []  # (key, sender, receiver), as assigned
    start = directory._start

    def spy(rec, sender, receiver, depth):
        edges.append((rec.key, sender, receiver))
        return start(rec, sender, receiver, depth)

    directory._start = spy
    src = workers[0]
    x = c.submit(np.arange, 300_000, dtype="f8", workers=[src.address])
    d = c.submit(dict, payload=b"y" * 400_000, workers=[src.address])
    await wait([x, d])
    ws = [w.address for w in workers]
    # The collectives are the synchronous API: called from a thread here.
    copies = await c.gather(await asyncio.to_thread(dh.broadcast, x, ws, 2))
    for got in copies:
        np.testing.assert_array_equal(got, np.arange(300_000, dtype="f8"))
    assert len(copies) == 7
    parts = {k for k, _, _ in edges}
    assert len(parts) == 2
    for k in parts:
        tree = {r: snd for key, snd, r in edges if key == k}
        # Each of the 6 other workers streamed the part once, along a tree.
        assert sorted(tree) == sorted(ws[1:])
        assert list(tree.values()).count(src.address) == 1
        # A tree of two levels below the holder's child, not a chain of 6.
        assert tree_depth(tree, src.address) <= 3
    # No worker sent more than 2 streams of half the object: the object once.
    out = [snd for _, snd, _ in edges]
    assert max(out.count(w) for w in ws) <= 2
    edges.clear()
    copies = await c.gather(await asyncio.to_thread(dh.broadcast, d, ws, 3))
    assert copies == [{"payload": b"y" * 400_000}] * 7
    assert len({k for k, _, _ in edges}) == 3
    assert [snd for _, snd, _ in edges].count(src.address) == 3


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_a_broadcast_with_bad_parts_names_the_argument(c, s, a, b):
    import pytest

    import dask_hoplite as dh

    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 10)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="broadcast parts must be a positive int"):
            await asyncio.to_thread(dh.broadcast, x, None, bad)


@gen_cluster(
    client=True,
    nthreads=[(f"127.0.0.{i}", 1) for i in range(1, 8)],
    config=SMALL,
    timeout=60,
    # reduce keeps its inputs until the result is done with a future
    # callback, which runs on Dask's callback thread.
    clean_kwargs={"threads": False},
)
async def test_a_reduce_in_parts_runs_one_tree_per_segment(c, s, *workers):
    import dask_hoplite as dh
    from dask_hoplite.collectives.futures import INPUTS_ATTR
    from dask_hoplite.core.reduce_plan import SplitTrees, plan_from_msg
    from dask_hoplite.worker import reduce_root

    await c.register_plugin(Hoplite())
    xs = [
        c.submit(np.full, 100_003, float(i + 1), workers=[w.address], pure=False)
        for i, w in enumerate(workers)
    ]
    await wait(xs)
    to = workers[3].address
    in_place: list[bool] = []
    join = reduce_root.join_segments

    def spy(shape, specs, segments, out=None):
        in_place.extend(out is not None and np.shares_memory(s, out) for s in segments)
        return join(shape, specs, segments, out)

    reduce_root.join_segments = spy
    try:
        result = await asyncio.to_thread(dh.reduce, xs, "sum", None, to, 3)
        got = await result
    finally:
        reduce_root.join_segments = join
    np.testing.assert_array_equal(got, np.full(100_003, float(sum(range(1, 8)))))
    # Each segment's root made its result in its place: no copy to join them.
    assert in_place == [True, True, True]
    plan = plan_from_msg(await getattr(result, INPUTS_ATTR))
    assert isinstance(plan, SplitTrees) and plan.root == to and len(plan.specs) == 3
    for spec in plan.specs:
        fan_in = Counter(p for p in spec.parent if p is not None)
        assert max(fan_in.values()) <= 3  # no node takes more than the object in
        assert len(fan_in) >= 2  # a tree, not a star into the root
    who = await c.scheduler.who_has(keys=[result.key])
    assert list(who[result.key]) == [to]
    # The /hoplite page and /metrics see one reduction (not one per segment)
    # of the whole object, its time against the whole object's S/B.
    log = s.plugins["hoplite"].collectives
    rid = plan.rid
    assert all(spec.reduction_rid == rid for spec in plan.specs)
    while not (rows := [r for r in log.recent if r.get("rid") == rid]):
        await asyncio.sleep(0.01)  # the root's report comes on the batched stream
    await asyncio.sleep(0.1)  # (and no other report of this reduction after it)
    rows = [r for r in log.recent if str(r.get("rid")).startswith(rid)]
    assert [(r["kind"], r["outcome"], r["nbytes"], r["inputs"]) for r in rows] == [
        ("reduce", "ok", got.nbytes, 7)
    ], rows
    import pytest

    with pytest.raises(ValueError, match="reduce parts must be a positive int"):
        await asyncio.to_thread(dh.reduce, xs, "sum", None, None, 0)


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 2,
    config={**SMALL, "hoplite.buffer-pool-reserve": "auto"},
    worker_kwargs={"memory_limit": "2 GiB"},
)
async def test_a_fresh_workers_first_large_object_lands_in_its_reserve(c, s, a, b):
    """By default each worker maps and faults in 1/16 of its memory limit
    when the plugin starts there (here 128 MiB), before the registration
    returns, so the first large transfer of a fresh cluster does not wait
    for the kernel to zero fresh pages."""
    await c.register_plugin(Hoplite())
    parts = b.plugins["hoplite-worker"].parts
    pool = parts.ctx.store.pool
    assert pool.idle_bytes == 128 * 2**20
    if parts.prefaulter is not None and parts.prefaulter.enabled:
        # faulted in before register_plugin returned, not under the transfer
        assert (parts.prefaulter.pending, parts.prefaulter.populated) == (0, 128 * 2**20)
    x = c.submit(np.full, 2**20, 1.0, workers=[a.address], pure=False)  # 8 MiB
    assert await c.submit(checksum, x, workers=[b.address]) == 2**20
    assert b.plugins["hoplite-worker"].stats["keys-received"] == 1
    assert (pool.reused, pool.allocated) == (1, 0)  # no fresh memory taken
