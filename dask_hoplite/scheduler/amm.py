"""Keep the Active Memory Manager away from replicas that a transfer needs.

The AMM drops replicas it considers redundant (``ReduceReplicas``). A replica
being streamed from, or being written by an unfinished stream, or taking part
in a running ``replicate``, looks redundant to it but is not: dropping it
breaks the stream or makes the replicate start over. This override wraps the
AMM's ``_find_dropper`` (the one place every policy's drop goes through) so
that such workers are never chosen; everything else is the AMM's own choice.
Installed only with ``hoplite.amm.protect-streams`` (the default) and when the
scheduler runs an AMM at all.

:class:`NeededReplicas` is one more such source (``hoplite.amm.keep-while-needed``):
every replica of a large key stays while tasks that need it have not
finished. The AMM keeps one per worker whose tasks wait for the key; work
stealing then moves a waiting task to an idle worker whose copy it had just
dropped, which fetches the whole object again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.measured_sizes import MeasuredSizes
from dask_hoplite.patching import AttributePatch

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

logger = logging.getLogger(__name__)


class NeededReplicas:
    """Pin source: the holders of a key of at least ``min_bytes`` (its size as
    the directory plans it: ``sizes``, measured or Dask's) while some task
    that needs it has not finished (``ts.waiters``)."""

    def __init__(
        self, task: Callable[[Key], TaskState | None], sizes: MeasuredSizes, min_bytes: int
    ) -> None:
        self._task = task
        self._sizes = sizes
        self._min_bytes = min_bytes

    def __call__(self, key: Key) -> set[str]:
        ts = self._task(key)
        if ts is None or not ts.waiters or self._sizes.size(key, ts.nbytes) < self._min_bytes:
            return set()
        return {ws.address for ws in ts.who_has or ()}


class StreamDropGuard:
    """``ActiveMemoryManagerExtension._find_dropper`` minus pinned workers.

    ``pin_sources``: each maps a key to the addresses whose copy of it must stay
    (the directory's active streams, the running replicate's pool).
    """

    def __init__(self, *pin_sources: Callable[[Key], set[str]]) -> None:
        self._sources = pin_sources
        self._scheduler: Scheduler | None = None
        self._original: Callable[..., Any] | None = None
        self._patch: AttributePatch | None = None

    def install(self, scheduler: Scheduler) -> None:
        if self._patch is not None:
            return
        amm = scheduler.extensions.get("amm")
        if amm is None:
            logger.debug("no Active Memory Manager on the scheduler: nothing to guard")
            return
        self._scheduler = scheduler
        self._original = amm._find_dropper
        self._patch = AttributePatch(amm, "_find_dropper", self._find_dropper)

    def restore(self) -> None:
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.undo()

    def pinned(self, ts: TaskState) -> set[WorkerState]:
        """The workers whose replica of ``ts`` must stay."""
        assert self._scheduler is not None
        addrs: set[str] = set()
        for source in self._sources:
            addrs |= source(ts.key)
        workers = self._scheduler.workers
        return {workers[a] for a in addrs if a in workers}

    def _find_dropper(
        self,
        ts: TaskState,
        candidates: set[WorkerState] | None,
        pending_drop: set[WorkerState],
    ) -> WorkerState | None:
        """The AMM's ``_find_dropper``, minus workers under an active stream."""
        assert self._original is not None
        pinned = self.pinned(ts)
        if pinned:
            candidates = (set(ts.who_has or ()) if candidates is None else candidates) - pinned
            if not candidates:
                return None
        return self._original(ts, candidates, pending_drop)
