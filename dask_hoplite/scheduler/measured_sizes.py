"""The scheduler's shell around :class:`~dask_hoplite.core.measured_sizes.MeasuredSizes`.

A worker that computed a key Dask cannot size reports its serialised size
(stream ``hoplite-measured``, sent before Dask's own report that the task
finished, on the same stream). From then on the directory and the replicate
override plan that key with the measured size, and every worker that gets a
task needing it is told the size (stream ``hoplite-sizes``) just before the
task itself: the scheduler's plugin hooks run before it sends the transition's
messages, so the worker knows when its fetch starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.measured_sizes import SIZES_OP, MeasuredSizes

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

logger = logging.getLogger(__name__)


class MeasuredSizesService:
    """Feeds the record from workers' reports and Dask's transitions.

    ``task`` looks a key up in the scheduler's task states; ``send(worker,
    msg)`` sends on the scheduler's stream to a worker."""

    def __init__(
        self,
        sizes: MeasuredSizes,
        task: Callable[[Key], TaskState | None],
        send: Callable[[str, dict[str, Any]], None],
    ) -> None:
        self.sizes = sizes
        self._task = task
        self._send = send

    def measured(self, key: Key, nbytes: int, worker: str | None = None, **kwargs: Any) -> None:
        """Stream ``hoplite-measured``: ``worker`` computed ``key``, ``nbytes``
        serialised, far more than Dask's estimate of it."""
        ts = self._task(key)
        if ts is None or ts.state not in ("processing", "memory"):
            return  # released or forgotten meanwhile: nothing to plan
        logger.info(
            "%r measures %d bytes serialised on %s (Dask's estimate: %s)",
            key,
            nbytes,
            worker,
            ts.nbytes,
        )
        self.sizes.measured(key, int(nbytes))

    def key_transitioned(self, key: Key, finish: str) -> None:
        """A task changed state: a measured key released or forgotten is
        forgotten here (measured again if recomputed); a task sent to a
        worker has that worker told the sizes of the measured keys it needs."""
        if finish in ("released", "forgotten", "erred"):
            self.sizes.forget(key)
        elif finish == "processing" and self.sizes:
            ts = self._task(key)
            ws = None if ts is None else ts.processing_on
            if ts is None or ws is None:
                return
            needed = [d.key for d in ts.dependencies if ws not in (d.who_has or ())]
            tell = self.sizes.consumer_placed(ws.address, needed)
            if tell:
                self._send(ws.address, {"op": SIZES_OP, "sizes": [[k, n] for k, n in tell.items()]})

    def worker_removed(self, address: str) -> None:
        self.sizes.worker_removed(address)
