"""Spread the tasks that need a large key at once, not at work stealing's next tick.

Dask places a task on a worker that holds one of its dependencies, so the
tasks needing a large key X land on the few workers holding X or their other
inputs, and work stealing moves the surplus to idle workers, one task per
idle worker per round, once a second
(``distributed.scheduler.work-stealing-interval``). A moved task's worker
then fetches X. Without hoplite each such fetch is another whole copy from a
holder, and a second's wait is small beside it; with hoplite every receiver
joins one tree and X reaches all of them in about S/B, so the idle second
before each move is the largest cost left. In a grid search on joblib's Dask
backend (16 fits needing a 256 MiB X, 8 workers, 1 Gbit/s), two workers got
their first fit 1-2 s after the others and, between the two rounds of fits,
workers sat idle 1-2 s each while the remaining fits waited in other
workers' queues.

:class:`PromptStealing` moves such tasks to idle workers shortly after either
event, through Dask's own steal protocol (``WorkStealing.move_task_request``:
the victim gives the task up only if it has not started it) and by Dask's own
rule for a steal (the idle worker's occupancy, plus the transfer of what the
task needs that it lacks, plus the task's duration, at most the victim's
occupancy less half of what the task costs there):

* a task that needs a key of at least ``hoplite.min-bytes`` is queued on a
  worker with all its threads taken while some worker is idle;
* a worker frees a thread while such a task is queued somewhere.

It moves only those tasks: others, and tasks with worker, host or resource
restrictions, are left to Dask's own cadence. (It does not run Dask's whole
balancing round early: that also moves seceded tasks' siblings, and a steal
confirmed for a task whose prefix Dask timed at zero fails an assertion in
``distributed.stealing`` that closes the victim's stream.) A move passes the
test Dask's stealing applies, only sooner; with work stealing off
(``distributed.scheduler.work-stealing: false``) nothing moves.
``hoplite.stealing.prompt`` turns it off; so does a release of distributed
that changed an internal it reads (the ``prompt-stealing`` feature of
:mod:`dask_hoplite.features`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.measured_sizes import MeasuredSizes

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

logger = logging.getLogger(__name__)


class DaskStealing:
    """The scheduler and its ``WorkStealing`` extension, as
    :class:`PromptStealing` reads and drives them: its counts and occupancies
    include the steals in flight, as Dask's balancing counts them."""

    def __init__(self, s: Scheduler, ext: Any) -> None:
        self._s = s
        self._ext = ext

    @classmethod
    def of(cls, s: Scheduler) -> DaskStealing | None:
        from distributed.stealing import WorkStealing

        ext = s.extensions.get("stealing")
        # Dask's own extension, whose internals dask_hoplite.compat checks.
        return cls(s, ext) if isinstance(ext, WorkStealing) else None

    def task(self, key: Key) -> TaskState | None:
        return self._s.tasks.get(key)

    def idle(self) -> list[WorkerState]:
        return list(self._s.idle.values())

    def nprocessing(self, ws: WorkerState) -> int:
        return len(ws.processing) + self._ext.in_flight_tasks[ws]

    def occupancy(self, ws: WorkerState) -> float:
        return float(ws.occupancy + self._ext.in_flight_occupancy[ws])

    def moving(self, ts: TaskState) -> bool:
        return ts in self._ext.in_flight

    def duration(self, ts: TaskState) -> float:
        """Dask's estimate of ``ts``'s compute time, as its stealing takes it."""
        return float(self._s._get_prefix_duration(ts.prefix))

    def comm_cost(self, ts: TaskState, ws: WorkerState) -> float:
        return float(self._s.get_comm_cost(ts, ws))

    def move(self, ts: TaskState, victim: WorkerState, thief: WorkerState) -> None:
        self._ext.move_task_request(ts, victim, thief)


class PromptStealing:
    """Moves queued tasks that need a large key to idle workers within
    ``delay`` seconds of an event that may allow it; at most one round per
    ``delay``.

    ``stealing``: the scheduler as :class:`DaskStealing` shows it;
    ``sizes``: measured sizes (a key is large by max(Dask's estimate,
    measured)); ``call_later(delay, fn)``: the event loop's timer. No I/O of
    its own: the scheduler's events come in through :meth:`key_transitioned`.
    """

    def __init__(
        self,
        stealing: DaskStealing,
        call_later: Callable[[float, Callable[[], None]], Any],
        sizes: MeasuredSizes,
        min_bytes: int,
        delay: float,
    ) -> None:
        self._stealing = stealing
        self._call_later = call_later
        self._sizes = sizes
        self._min_bytes = min_bytes
        self._delay = delay
        #: Tasks in processing that need a large key (queued or running).
        self.queued: set[Key] = set()
        self._pending = False
        #: Steals requested (a figure for tests and the logs).
        self.moves = 0
        #: The worker each task was asked to move from. A task still
        #: processing there at a later round was refused: the worker had
        #: started it ("already-computing" in Dask's stealing log), and asking
        #: again would only cost the round another idle worker could use.
        self._asked: dict[Key, WorkerState] = {}

    @classmethod
    def on_scheduler(
        cls, s: Scheduler, sizes: MeasuredSizes, min_bytes: int, delay: float
    ) -> PromptStealing | None:
        """One driving ``s``'s work stealing, or None when it has none."""
        stealing = DaskStealing.of(s)
        if stealing is None:
            logger.debug("no work stealing on the scheduler: tasks keep Dask's placement")
            return None
        return cls(stealing, s.loop.call_later, sizes, min_bytes, delay)

    def needs_large(self, ts: TaskState) -> bool:
        """Whether ``ts`` was placed by Dask next to a large dependency: it
        needs a key of at least ``min_bytes`` and has no restrictions (where a
        user or a hoplite collective put a task stays its business)."""
        if ts.worker_restrictions or ts.host_restrictions or ts.resource_restrictions:
            return False
        return any(
            self._sizes.size(dts.key, dts.nbytes) >= self._min_bytes for dts in ts.dependencies
        )

    def key_transitioned(self, key: Key, start: str, finish: str) -> None:
        if finish == "processing":
            ts = self._stealing.task(key)
            if ts is None or ts.processing_on is None or not self.needs_large(ts):
                return
            self.queued.add(key)
            ws = ts.processing_on
            if len(ws.processing) > ws.nthreads:
                self._soon()
        elif start == "processing":
            self.queued.discard(key)
            self._asked.pop(key, None)
            if self.queued:
                # A thread freed (or a task moved): a queued task may go there.
                self._soon()

    def _soon(self) -> None:
        if not self._pending:
            self._pending = True
            self._call_later(self._delay, self._run)

    def _run(self) -> None:
        self._pending = False
        try:
            self.moves += self.steal()
        except Exception:  # the scheduler's state moved under us; Dask's tick remains
            logger.exception("prompt stealing failed")

    def _candidates(self) -> dict[WorkerState, list[TaskState]]:
        """Per worker with more tasks than threads, its tasks that need a
        large key and may move (not being moved, not refused already by that
        worker, a duration Dask estimates above zero: Dask's steal
        bookkeeping requires one)."""
        st = self._stealing
        out: dict[WorkerState, list[TaskState]] = {}
        for key in self.queued:
            ts = st.task(key)
            ws = ts.processing_on if ts is not None else None
            if ts is None or ws is None or st.nprocessing(ws) <= ws.nthreads:
                continue
            if st.moving(ts) or st.duration(ts) <= 0 or self._asked.get(key) is ws:
                continue
            out.setdefault(ws, []).append(ts)
        return out

    def steal(self) -> int:
        """One round: each idle worker takes at most one queued task from the
        worker with the most tasks beyond its threads, if Dask's rule for a
        steal allows it. The task taken is the victim's last in priority
        order (the least likely to have started). Returns the steals asked."""
        st = self._stealing
        thieves = sorted(st.idle(), key=st.occupancy)
        if not thieves:
            return 0
        candidates = self._candidates()
        moved = 0
        for thief in thieves:
            victims = sorted(
                (v for v in candidates if v is not thief and candidates[v]),
                key=lambda v: st.nprocessing(v) - v.nthreads,
                reverse=True,
            )
            for victim in victims:
                if st.nprocessing(victim) <= victim.nthreads:
                    continue
                ts = max(candidates[victim], key=lambda t: t.priority or ())
                compute = st.duration(ts)
                cost_there = st.occupancy(thief) + st.comm_cost(ts, thief) + compute
                wait_here = st.occupancy(victim) - (st.comm_cost(ts, victim) + compute) / 2
                if cost_there <= wait_here:
                    st.move(ts, victim, thief)
                    self._asked[ts.key] = victim
                    candidates[victim].remove(ts)
                    moved += 1
                    break
        return moved
