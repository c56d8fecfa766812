"""One copy per host (issue 42) on a real cluster of worker processes on this
machine: the workers that need a large key hold it once, mapped; a task's
writes stay in its own worker; the pages go when the key does, a killed
worker included."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import psutil
import pytest
from conftest import process_workers
from distributed import Future

from dask_hoplite.worker import memfd_regions

pytestmark = pytest.mark.skipif(
    not memfd_regions.available(), reason="needs Linux 5.1+ memfds and seals"
)

N = 8 * 2**20  # float64s: 64 MiB
S = N * 8
TAG = "memfd:dask-hoplite"
#: Replicas stay where client.replicate put them (Dask's Active Memory
#: Manager would drop the extra ones after a while).
KEEP_REPLICAS = {"distributed.scheduler.active-memory-manager.start": False}


def _shmem() -> int:
    """The host's shared memory in bytes (``Shmem`` of ``/proc/meminfo``),
    where memfd pages are counted."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def _region_bytes(dask_worker=None) -> dict[str, int]:
    """This process's mappings of hoplite regions: their RSS and PSS."""
    rss = pss = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                inside = TAG in line
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1]) * 1024
            elif inside and line.startswith("Pss:"):
                pss += int(line.split()[1]) * 1024
    return {"rss": rss, "pss": pss}


def _holding(pids) -> list[int]:
    """Those of ``pids`` that map a hoplite region or hold its descriptor."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped = TAG in f.read()
            held = any(
                TAG in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
            )
        except (FileNotFoundError, ProcessLookupError):
            continue
        if mapped or held:
            out.append(pid)
    return out


def _stats(dask_worker):
    return dict(dask_worker.plugins["hoplite-worker"].parts.ctx.stats)


def _touch(key, dask_worker):
    """Read every byte of this worker's copy (faults its pages in)."""
    return float(dask_worker.data[key].sum())


def _cluster_pids() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)]


@dataclasses.dataclass
class Replicated:
    """An array made on ``src`` and replicated to ``others``: ``receiver``
    streamed it, the others of them mapped its region. ``want`` is its sum."""

    x: Future
    src: str
    others: list[str]
    receiver: str
    want: float


def _replicate(client, n: int = N) -> Replicated:
    """``np.arange(n)`` made on the first worker, replicated to the others."""
    src, *others = sorted(client.scheduler_info()["workers"])
    x = client.submit(np.arange, n, dtype="f8", workers=[src], pure=False)
    client.replicate(x, workers=others)
    stats = client.run(_stats, workers=others)
    receiver = next(w for w in others if not stats[w].get("keys-mapped"))
    return Replicated(x, src, others, receiver, float(np.arange(n, dtype="f8").sum()))


def test_the_workers_of_a_host_hold_one_copy_between_them():
    """A key replicated from one worker to the three others of its host: one
    of them receives it, the two others map its pages. All three read it
    right, and the pages are held once: the regions' PSS over the workers
    comes to one object, where their RSS counts it in every process."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client)
        src, others = r.src, r.others
        assert client.run(_touch, r.x.key, workers=others) == dict.fromkeys(others, r.want)
        stats = client.run(_stats, workers=others)
        assert sorted(s.get("keys-mapped", 0) for s in stats.values()) == [0, 1, 1], stats
        held = client.run(_region_bytes, workers=[src, *others])
        assert held[src] == {"rss": 0, "pss": 0}  # the source's is its task's array
        pss = sum(h["pss"] for h in held.values())
        rss = sum(h["rss"] for h in held.values())
        assert 0.95 * S <= pss <= 1.05 * S, held
        assert rss >= 3 * S, held  # what Dask's memory manager would read


def test_a_task_that_writes_into_a_shared_input_changes_only_its_own_copy():
    """A task writes into its input on the worker that received the key, and
    one on a worker that mapped it: each gets its own answer, and a task on
    a third worker of the host then reads the original values."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client)
        x, receiver = r.x, r.receiver
        mapper, reader = (w for w in r.others if w != receiver)

        def write_then_sum(a):
            a[: N // 2] = -1.0
            return float(a.sum())

        want_written = -(N // 2) + float(np.arange(N // 2, N, dtype="f8").sum())
        for w in (receiver, mapper):
            got = client.submit(write_then_sum, x, workers=[w], pure=False).result()
            assert got == want_written
        assert client.submit(np.sum, x, workers=[reader], pure=False).result() == r.want
        assert client.run(_touch, x.key, workers=[reader]) == {reader: r.want}


def test_killing_a_holder_and_releasing_the_key_frees_the_hosts_memory():
    """SIGKILL of the worker that received the key: the others still read
    it from the pages they map. Once the key is released, no process holds a
    region, the host's shared memory is back where it was, and nothing is
    left in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        pids = {n.worker_address: n.process.pid for n in cluster.workers.values()}
        before = _shmem()
        r = _replicate(client)
        assert client.run(_touch, r.x.key, workers=r.others) == dict.fromkeys(r.others, r.want)
        assert _shmem() - before >= 0.95 * S  # the region is in shared memory
        os.kill(pids[r.receiver], signal.SIGKILL)
        alive = [w for w in r.others if w != r.receiver]
        assert client.run(_touch, r.x.key, workers=alive) == dict.fromkeys(alive, r.want)
        del r
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            _holding(_cluster_pids()) or _shmem() - before > 0.05 * S
        ):
            time.sleep(0.1)
        assert _holding(_cluster_pids()) == []
        assert _shmem() - before <= 0.05 * S
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_a_partial_copy_completed_from_a_local_recomputation_leaves_its_region():
    """A key received into a region, part way, then computed on this very
    worker (its holders died): the buffer adopts the local bytes, and
    neither its tasks nor the other workers of the host are given the
    region's half-filled bytes any more."""
    import asyncio

    from dask_hoplite.core.store import BlockStore, ObjectBuffer
    from dask_hoplite.worker.context import serialize_for_streams
    from dask_hoplite.worker.host_sharing import HostSharing

    store = BlockStore()
    sharing = HostSharing(store, "tcp://127.0.0.1:1")
    value = np.arange(1024, dtype="f8")
    header, frames = serialize_for_streams(value)
    source = ObjectBuffer.from_frames("x", header, frames)
    buf = store.announce("x")
    sharing.receive_into_region(buf)
    buf.allocate(source.layout)
    buf.write(0, source.view(0, 4096))  # half of it, then its sender died
    assert sharing.region_of(buf) is not None
    buf.adopt(source)
    assert sharing.region_of(buf) is None
    got = np.frombuffer(b"".join(bytes(f) for f in sharing.task_frames(buf)), dtype="f8")
    assert np.array_equal(got, value)
    assert asyncio.run(sharing._lookup("x")) is None


def test_a_shared_copy_does_not_make_dask_pause_or_spill_its_workers():
    """Memory limits set so that the receiver's RSS, which counts the
    region's pages once per mapping (its writable one and its task's), is
    past Dask's pause threshold (80%) and spill threshold (70%): Dask sees
    the shared pages at their share and pauses and spills nothing. The
    nanny's terminate threshold, which still reads RSS, is off."""
    n = 32 * 2**20  # float64s: 256 MiB
    limit = 640 * 2**20
    config = {**KEEP_REPLICAS, "distributed.worker.memory.terminate": False}
    with process_workers(4, config, memory_limit=limit) as (cluster, client):
        r = _replicate(client, n)
        src, others, receiver = r.src, r.others, r.receiver
        assert client.run(_touch, r.x.key, workers=others) == dict.fromkeys(others, r.want)

        def rss(dask_worker):
            return psutil.Process().memory_info().rss

        def state(dask_worker):
            return str(dask_worker.status), len(dask_worker.data.slow)

        time.sleep(1.0)  # ten of the memory monitor's rounds
        assert client.run(state) == dict.fromkeys([src, *others], ("Status.running", 0))
        # What Dask's own reading would have been: past the pause threshold.
        assert client.run(rss, workers=[receiver])[receiver] > 0.8 * limit
        assert client.run(_touch, r.x.key, workers=others) == dict.fromkeys(others, r.want)


def _spill(key, dask_worker) -> bool:
    """Spill ``key`` to this worker's disk, as Dask's memory manager would:
    True once it is there and out of memory."""
    data = dask_worker.data
    while key in data.fast:
        if data.evict() < 0:
            return False
    return key in data.slow


def _sum_in_task(client, x, workers) -> dict[str, float]:
    """``x.sum()`` computed by a task on each of ``workers``."""
    futs = {w: client.submit(np.sum, x, workers=[w], pure=False) for w in workers}
    return {w: float(f.result()) for w, f in futs.items()}


def test_spilling_a_shared_copy_leaves_the_others_on_the_host_right():
    """The worker that received the key (its region's creator) and then one
    that mapped it spill it to disk: every worker of the host still reads
    the right values, those two from disk, the others from the pages they
    map; a task that writes into the unspilled input changes nothing else."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client)
        mapper = next(w for w in r.others if w != r.receiver)
        assert client.run(_spill, r.x.key, workers=[r.receiver]) == {r.receiver: True}
        rest = [w for w in r.others if w != r.receiver]
        assert client.run(_touch, r.x.key, workers=rest) == dict.fromkeys(rest, r.want)
        assert client.run(_spill, r.x.key, workers=[mapper]) == {mapper: True}
        everyone = [r.src, *r.others]
        assert _sum_in_task(client, r.x, everyone) == dict.fromkeys(everyone, r.want)
        assert client.run(_touch, r.x.key, workers=everyone) == dict.fromkeys(everyone, r.want)


def test_the_amm_dropping_replicas_leaves_the_last_holders_copy_right():
    """Dask's Active Memory Manager drops the replicas nobody waits on,
    those of the region's creator among them or not: the copy it keeps reads
    right, and tasks on the workers that dropped theirs fetch it again and
    get the right values."""
    config = {
        "distributed.scheduler.active-memory-manager.start": True,
        "distributed.scheduler.active-memory-manager.interval": "100ms",
    }
    with process_workers(4, config) as (cluster, client):
        src, *others = sorted(client.scheduler_info()["workers"])
        x = client.submit(np.arange, N, dtype="f8", workers=[src], pure=False)
        want = float(np.arange(N, dtype="f8").sum())
        # Tasks on the others make them fetch it; once they have run, the
        # AMM drops the extra replicas.
        assert _sum_in_task(client, x, others) == dict.fromkeys(others, want)
        mapped = sum(s.get("keys-mapped", 0) for s in client.run(_stats, workers=others).values())
        assert mapped >= 1  # the host's workers shared a copy

        def holders() -> set[str]:
            return set(client.who_has([x])[x.key])

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(holders()) > 1:
            time.sleep(0.1)
        kept = holders()
        assert len(kept) == 1, kept
        assert client.run(_touch, x.key, workers=list(kept)) == dict.fromkeys(kept, want)
        everyone = [src, *others]
        assert _sum_in_task(client, x, everyone) == dict.fromkeys(everyone, want)


def test_retiring_the_worker_that_received_a_shared_copy_leaves_the_others_right():
    """``retire_workers`` of the worker whose region the others of its host
    map: it closes gracefully, and the workers that map its pages still read
    the right values and serve them to new tasks."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client)
        client.retire_workers([r.receiver])
        alive = [w for w in r.others if w != r.receiver]
        assert r.receiver not in client.scheduler_info()["workers"]
        assert client.run(_touch, r.x.key, workers=alive) == dict.fromkeys(alive, r.want)
        client.retire_workers([r.src])
        assert set(client.who_has([r.x])[r.x.key]) == set(alive)
        assert _sum_in_task(client, r.x, alive) == dict.fromkeys(alive, r.want)
