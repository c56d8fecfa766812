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


def _no_sharing(dask_worker) -> None:
    """This worker holds and serves no shared regions (as one whose region
    server could not start): its peers on the host stream from it."""
    ctx = dask_worker.plugins["hoplite-worker"].parts.ctx
    ctx.sharing.close()
    ctx.sharing = None


@dataclasses.dataclass
class Replicated:
    """An array made on ``src`` and replicated to ``others``, who map the
    region of ``creator``. ``want`` is its sum."""

    x: Future
    src: str
    others: list[str]
    #: The worker whose region the host's copies are: ``src``, which copied
    #: its array into one to hand out, or the one of ``others`` that
    #: streamed the array into it (``streamed``).
    creator: str
    streamed: bool
    want: float

    @property
    def mappers(self) -> list[str]:
        """The workers that mapped ``creator``'s region."""
        return [w for w in self.others if w != self.creator]


def _replicate(client, n: int = N, streamed: bool = False) -> Replicated:
    """``np.arange(n)`` made on the first worker, replicated to the others.
    ``streamed``: the first worker does not share, so one of the others
    streams it into a region of its own and the rest map that."""
    src, *others = sorted(client.scheduler_info()["workers"])
    if streamed:
        client.run(_no_sharing, workers=[src])
    x = client.submit(np.arange, n, dtype="f8", workers=[src], pure=False)
    client.replicate(x, workers=others)
    stats = client.run(_stats, workers=others)
    mapped = [w for w in others if stats[w].get("keys-mapped")]
    if streamed:
        [creator] = [w for w in others if w not in mapped]
    else:
        assert mapped == others, stats
        creator = src
    return Replicated(x, src, others, creator, streamed, float(np.arange(n, dtype="f8").sum()))


@pytest.mark.parametrize("streamed", [False, True], ids=["handed-out", "streamed"])
def test_the_workers_of_a_host_hold_one_copy_between_them(streamed):
    """A key replicated from one worker to the three others of its host. The
    source copies it into a region that all three map, or (``streamed``:
    the source does not share) one of them receives it into a region and
    the two others map that. All three read it right, and the pages are held
    once: the regions' PSS over the workers comes to one object, where their
    RSS counts it in every process."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client, streamed=streamed)
        src, others = r.src, r.others
        assert client.run(_touch, r.x.key, workers=others) == dict.fromkeys(others, r.want)
        held = client.run(_region_bytes, workers=[src, *others])
        if streamed:  # the source's copy is its task's array
            assert held[src] == {"rss": 0, "pss": 0}
        pss = sum(h["pss"] for h in held.values())
        rss = sum(h["rss"] for h in held.values())
        assert 0.95 * S <= pss <= 1.05 * S, held
        assert rss >= 3 * S, held  # what Dask's memory manager would read


def test_a_handed_out_copy_is_let_go_by_its_source_and_lives_on_in_its_mappers():
    """The source lets go of the copy it made to hand out once no worker
    asks for it any more; the workers that map it still read it, and a
    fourth worker that needs it later maps theirs (no stream)."""
    from dask_hoplite.worker import host_sharing

    with process_workers(5, KEEP_REPLICAS) as (cluster, client):
        workers = sorted(client.scheduler_info()["workers"])
        src, others, late = workers[0], workers[1:4], workers[4]
        x = client.submit(np.arange, N, dtype="f8", workers=[src], pure=False)
        client.replicate(x, workers=others)
        want = float(np.arange(N, dtype="f8").sum())
        deadline = time.monotonic() + host_sharing.LINGER + 10
        while time.monotonic() < deadline and client.run(_region_bytes, workers=[src])[src]["rss"]:
            time.sleep(0.2)
        assert client.run(_region_bytes, workers=[src])[src] == {"rss": 0, "pss": 0}
        assert client.run(_touch, x.key, workers=others) == dict.fromkeys(others, want)
        client.replicate(x, workers=[*others, late])
        assert client.run(_stats, workers=[late])[late].get("keys-mapped") == 1
        assert client.run(_touch, x.key, workers=[late]) == {late: want}
        held = client.run(_region_bytes, workers=[*others, late])
        assert 0.95 * S <= sum(h["pss"] for h in held.values()) <= 1.05 * S, held


def test_a_task_that_writes_into_a_shared_input_changes_only_its_own_copy():
    """A task writes into its input on the worker that received the key, and
    one on a worker that mapped it: each gets its own answer, and a task on
    a third worker of the host then reads the original values."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client, streamed=True)
        x, receiver = r.x, r.creator
        mapper, reader = r.mappers

        def write_then_sum(a):
            a[: N // 2] = -1.0
            return float(a.sum())

        want_written = -(N // 2) + float(np.arange(N // 2, N, dtype="f8").sum())
        for w in (receiver, mapper):
            got = client.submit(write_then_sum, x, workers=[w], pure=False).result()
            assert got == want_written
        assert client.submit(np.sum, x, workers=[reader], pure=False).result() == r.want
        assert client.run(_touch, x.key, workers=[reader]) == {reader: r.want}


@pytest.mark.parametrize("streamed", [False, True], ids=["handed-out", "streamed"])
def test_killing_a_holder_and_releasing_the_key_frees_the_hosts_memory(streamed):
    """SIGKILL of the worker whose region the others map (the source that
    handed out a copy, or the receiver that streamed it): the others still
    read it from the pages they map. Once the key is released, no process
    holds a region, the host's shared memory is back where it was, and
    nothing is left in /dev/shm."""
    shm_before = set(os.listdir("/dev/shm"))
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        pids = {n.worker_address: n.process.pid for n in cluster.workers.values()}
        before = _shmem()
        r = _replicate(client, streamed=streamed)
        assert client.run(_touch, r.x.key, workers=r.others) == dict.fromkeys(r.others, r.want)
        assert _shmem() - before >= 0.95 * S  # the region is in shared memory
        os.kill(pids[r.creator], signal.SIGKILL)
        alive = r.mappers
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
    region's half-filled bytes any more (they get a copy of the adopted
    ones)."""
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

    async def handed_out() -> bytes:
        region = await sharing._lookup("x")
        assert region is not None and region.sealed
        try:
            return bytes(region.private())
        finally:
            sharing.close()

    # What the host's other workers get is a copy of the adopted bytes.
    assert asyncio.run(handed_out()) == b"".join(bytes(f) for f in frames)


def test_a_shared_copy_does_not_make_dask_pause_spill_or_restart_its_workers():
    """Memory limits set so that the receiver's RSS, which counts the
    region's pages once per mapping (its writable one and its task's), is
    past Dask's terminate (95%), pause (80%) and spill (70%) thresholds: Dask
    and the nannies see the shared pages at their share, and pause, spill
    and restart nothing."""
    n = 64 * 2**20  # float64s: 512 MiB
    limit = 1100 * 2**20
    with process_workers(4, KEEP_REPLICAS, memory_limit=limit) as (cluster, client):
        pids = client.run(os.getpid)
        r = _replicate(client, n, streamed=True)
        src, others, receiver = r.src, r.others, r.creator
        assert client.run(_touch, r.x.key, workers=others) == dict.fromkeys(others, r.want)

        def rss(dask_worker):
            return psutil.Process().memory_info().rss

        def state(dask_worker):
            return str(dask_worker.status), len(dask_worker.data.slow)

        time.sleep(1.0)  # ten of the memory monitors' rounds
        assert client.run(state) == dict.fromkeys([src, *others], ("Status.running", 0))
        # What Dask's own reading would have been: past the terminate threshold.
        assert client.run(rss, workers=[receiver])[receiver] > 0.95 * limit
        assert client.run(os.getpid) == pids  # no worker restarted
        assert not [e for _, e in client.get_events("worker-restart-memory")]
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
        r = _replicate(client, streamed=True)
        mapper = r.mappers[0]
        assert client.run(_spill, r.x.key, workers=[r.creator]) == {r.creator: True}
        rest = r.mappers
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


@pytest.mark.parametrize("streamed", [False, True], ids=["handed-out", "streamed"])
def test_retiring_the_worker_whose_region_the_others_map_leaves_them_right(streamed):
    """``retire_workers`` of the worker whose region the others of its host
    map (the source that handed out a copy, or the receiver that streamed
    it): it closes gracefully, and the workers that map its pages still read
    the right values and serve them to new tasks."""
    with process_workers(4, KEEP_REPLICAS) as (cluster, client):
        r = _replicate(client, streamed=streamed)
        client.retire_workers([r.creator])
        assert r.creator not in client.scheduler_info()["workers"]
        alive = r.mappers
        assert client.run(_touch, r.x.key, workers=alive) == dict.fromkeys(alive, r.want)
        if r.src in client.scheduler_info()["workers"]:
            client.retire_workers([r.src])
        assert set(client.who_has([r.x])[r.x.key]) == set(alive)
        assert _sum_in_task(client, r.x, alive) == dict.fromkeys(alive, r.want)


def test_the_nannies_get_dasks_own_memory_check_back_when_the_part_is_removed():
    """With host sharing on, every nanny's memory monitor goes through
    hoplite's gate; unregistering the nanny part puts Dask's own back."""
    from dask_hoplite.worker.nanny_memory import MONITOR, HopliteNanny, gated_monitor

    def monitor(dask_worker) -> str:
        pc = dask_worker.periodic_callbacks[MONITOR]
        func = getattr(pc.callback, "func", pc.callback)
        running = "running" if pc.is_running() else "stopped"
        return f"{getattr(func, '__name__', func)} {running}"

    with process_workers(2, memory_limit=2**30) as (cluster, client):
        gated = f"{gated_monitor.__name__} running"
        assert set(client.run(monitor, nanny=True).values()) == {gated}
        client.unregister_worker_plugin(HopliteNanny.name, nanny=True)
        assert set(client.run(monitor, nanny=True).values()) == {"memory_monitor running"}
