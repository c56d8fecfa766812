"""``client.replicate`` and ``scatter(broadcast=True)`` of large keys in one
pipelined step, safe with the Active Memory Manager on.

Dask's ``Scheduler.replicate`` copies in generations: each holder sends whole
objects to ``branching_factor`` new holders, then the next generation starts;
with the Active Memory Manager on, replicas made in one generation can be
dropped before the next, which then makes them again. With hoplite all missing
replicas are requested at once and the directory chains the streams, while the
keys' holders and targets are pinned against the AMM (see :mod:`.amm`).

This override replaces the ``replicate`` RPC handler and ``Scheduler.replicate``
(which ``scatter(broadcast=True)`` calls). Keys under ``hoplite.min-bytes`` go
to Dask's own ``replicate``, unchanged. Large keys go through
:meth:`ReplicateOverride._replicate_large`: Dask's algorithm rebuilt from Dask's
own pieces (``_replica_lock``, ``workers_list``, ``delete_worker_data``,
``gather_on_worker``, which also records each new replica), not a call of
Dask's ``replicate``.

Why not call Dask's ``replicate`` for them, with a branching factor >= n (one
generation) and the keys pinned? That keeps the normal case, but not the
failure cases, because of these lines of ``Scheduler.replicate`` (distributed
2026.8.0, ``distributed/scheduler.py``):

- ``while tasks:`` (line 7261) ends only when every key has ``n`` replicas in
  ``ts.who_has & workers`` or is forgotten; there is no bound on generations.
  With ``workers=`` given, ``workers`` is a snapshot (line 7220) that keeps a
  worker which died mid-replicate: it is sampled again every generation, its
  gather fails every time, and the call never returns (measured: no answer
  within 10 s). A target whose gather keeps failing does the same, and an AMM
  that drops replicas between generations (``hoplite.amm.protect-streams``
  off) makes it redo them for as long as it keeps dropping. Here: at most
  :data:`MAX_ROUNDS` rounds, replicas achieved stay counted, and the keys
  still short are reported as ``{"status": "partial-fail", "keys": [...]}``.
- ``workers = self.running`` (line 7223): without ``workers=``, the pool is the
  scheduler's live set, but ``n`` was fixed before the loop; when a worker dies
  mid-replicate, ``random.sample(tuple(workers - ts.who_has), count)`` (line
  7278) raises ``ValueError: Sample larger than population`` (measured). Here:
  the pool is a snapshot, and the result is partial-fail.
- ``assert ts.who_has is not None`` (line 7268): a key whose last holder died
  mid-replicate raises ``AssertionError`` (measured). Here: a key no longer in
  memory is skipped (Dask recomputes it; there is nothing to copy).

Surviving these from outside Dask's call would take cancelling it on a worker's
removal and on a key's loss, plus a bound on repeated gather failures: more
machinery than the loop below, and still a different result.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.core import Status

from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.measured_sizes import MeasuredSizes
from dask_hoplite.patching import AttributePatch, ItemPatch

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

#: Rounds of gathers a replicate of large keys makes before it reports the
#: keys still short of ``n`` replicas.
MAX_ROUNDS = 3

#: Per target worker, the keys to gather and their holders (``gather_on_worker``'s ``who_has``).
Gathers = defaultdict[str, dict[Key, list[str]]]


class ReplicateOverride:
    """The ``replicate`` handler and ``Scheduler.replicate``, large keys pipelined.

    ``pins`` maps a key to the workers a running replicate reads it from or
    writes it to (the AMM guard keeps them); shared with a previous instance
    when a newly registered plugin takes over.
    """

    def __init__(
        self,
        config: HopliteConfig,
        pins: defaultdict[Key, set[str]] | None = None,
        sizes: MeasuredSizes | None = None,
    ) -> None:
        self.config = config
        #: Sizes workers measured where Dask's estimate is wrong.
        self.sizes = MeasuredSizes() if sizes is None else sizes
        self.pins: defaultdict[Key, set[str]] = defaultdict(set) if pins is None else pins
        #: What ``install`` replaced: the scheduler's own ``replicate`` handler.
        self.original: Callable[..., Any] | None = None
        self._scheduler: Scheduler | None = None
        self._patches: list[AttributePatch | ItemPatch] = []

    def install(self, scheduler: Scheduler) -> None:
        if self._patches:
            return
        self._scheduler = scheduler
        self.original = scheduler.handlers["replicate"]
        self._patches = [
            ItemPatch(scheduler.handlers, "replicate", self.replicate),
            # scatter(broadcast=True) calls self.replicate, not the handler.
            AttributePatch(scheduler, "replicate", self.replicate),
        ]

    def restore(self) -> None:
        patches, self._patches = self._patches, []
        for patch in reversed(patches):
            patch.undo()

    def pinned(self, key: Key) -> set[str]:
        """The workers a running replicate reads ``key`` from or writes it to."""
        return self.pins.get(key, set())

    async def replicate(
        self,
        keys: list[Key],
        n: int | None = None,
        workers: Iterable[str] | None = None,
        branching_factor: int = 2,
        delete: bool = True,
        stimulus_id: str | None = None,
    ) -> dict[str, Any] | None:
        """``Scheduler.replicate`` with large keys copied in one pipelined step.

        Dask copies in generations (each holder feeds ``branching_factor`` new
        ones, whole objects, then the next generation starts). With hoplite all
        missing replicas are requested at once and the directory chains them.
        Small keys keep Dask's own algorithm.
        """
        s = self._scheduler
        assert s is not None and self.original is not None
        if workers is not None:
            workers = list(workers)  # used twice below
        large = [
            k
            for k in keys
            if k in s.tasks and self.sizes.size(k, s.tasks[k].nbytes) >= self.config.min_bytes
        ]
        large_set = set(large)
        small = [k for k in keys if k not in large_set]
        result = None
        if small:
            result = await self.original(
                keys=small,
                n=n,
                workers=workers,
                branching_factor=branching_factor,
                delete=delete,
                stimulus_id=stimulus_id,
            )
        if large:
            failed = await self._replicate_large(s, large, n, workers, delete, stimulus_id)
            if failed:
                prev = result["keys"] if result else []
                result = {"status": "partial-fail", "keys": list(prev) + failed}
        return result

    async def _replicate_large(
        self,
        s: Scheduler,
        keys: list[Key],
        n: int | None,
        workers: list[str] | None,
        delete: bool,
        stimulus_id: str | None,
    ) -> list[Key]:
        """Dask's replicate of ``keys`` in rounds of all missing replicas at
        once; the keys still short of ``n`` replicas (and still in memory)."""
        stimulus_id = stimulus_id or "hoplite-replicate"
        async with s._replica_lock(("replicate", object())):
            pool = _pool(s, workers)
            n = len(pool) if n is None else min(n, len(pool))
            if n == 0:
                raise ValueError("Can not use replicate to delete data")
            tasks = [s.tasks[k] for k in keys]
            lost = [ts.key for ts in tasks if not ts.who_has]
            if lost:
                return lost
            if delete:
                await _drop_extra(s, tasks, pool, n, stimulus_id)
            # Replicas this call achieved: later AMM drops do not undo them.
            achieved = {ts.key: {ws for ws in (ts.who_has or ()) if ws in pool} for ts in tasks}
            for _ in range(MAX_ROUNDS):
                gathers = _plan_round(tasks, pool, n, achieved)
                if not gathers:
                    break
                await self._gather(s, gathers, achieved)
            return [ts.key for ts in tasks if len(achieved[ts.key]) < n and ts.state == "memory"]

    async def _gather(
        self, s: Scheduler, gathers: Gathers, achieved: dict[Key, set[WorkerState]]
    ) -> None:
        """One round: every target gathers its keys at once (the directory
        chains the streams), with holders and targets pinned meanwhile."""
        for addr, who_has in gathers.items():
            for k, holders in who_has.items():
                self.pins[k].update(holders)
                self.pins[k].add(addr)
        try:
            failed_per_worker = await asyncio.gather(
                *(s.gather_on_worker(addr, wh) for addr, wh in gathers.items())
            )
        finally:
            for who_has in gathers.values():
                for k in who_has:
                    self.pins.pop(k, None)
        for (addr, who_has), failed in zip(gathers.items(), failed_per_worker, strict=True):
            target = s.workers.get(addr)
            for k in who_has:
                if k not in failed and target is not None:
                    achieved[k].add(target)


def _pool(s: Scheduler, workers: list[str] | None) -> set[WorkerState]:
    """The running workers replicas go to (a snapshot, unlike Dask's)."""
    if workers is None:
        return set(s.running)
    pool = {s.workers[w] for w in s.workers_list(workers)}
    return {ws for ws in pool if ws.status == Status.running}


async def _drop_extra(
    s: Scheduler, tasks: list[TaskState], pool: set[WorkerState], n: int, stimulus_id: str
) -> None:
    """``delete=True``: drop replicas in the pool beyond ``n``, at random."""
    drop: defaultdict[WorkerState, list[Key]] = defaultdict(list)
    for ts in tasks:
        have = tuple(ws for ws in (ts.who_has or ()) if ws in pool)
        if len(have) > n:
            for ws in random.sample(have, len(have) - n):
                drop[ws].append(ts.key)
    await asyncio.gather(
        *(s.delete_worker_data(ws.address, ks, stimulus_id) for ws, ks in drop.items())
    )


def _plan_round(
    tasks: list[TaskState], pool: set[WorkerState], n: int, achieved: dict[Key, set[WorkerState]]
) -> Gathers:
    """All the replicas still missing, each from all current holders."""
    gathers: Gathers = defaultdict(dict)
    for ts in tasks:
        if ts.state != "memory" or not ts.who_has:
            continue
        missing = n - len(achieved[ts.key])
        if missing <= 0:
            continue
        free = list(pool - achieved[ts.key] - set(ts.who_has))
        holders = [ws.address for ws in ts.who_has]
        for ws in random.sample(free, min(missing, len(free))):
            gathers[ws.address][ts.key] = holders
    return gathers
