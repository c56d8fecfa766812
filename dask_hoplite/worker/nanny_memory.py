"""The nanny's reading of its worker's memory, with pages shared with the
other workers of the host counted at their share (issue 42: one copy per
host).

A nanny terminates its worker when the worker's RSS passes
``distributed.worker.memory.terminate`` of its memory limit (95% by default),
reading it itself every ``distributed.worker.memory.monitor-interval``
(``NannyMemoryManager.memory_monitor``). RSS counts a page in every process
that maps it, so a worker that maps a large key shared with the other workers
of its host could be killed for memory the host holds once.

:class:`HopliteNanny`, a nanny plugin that the scheduler part registers where
``hoplite.host-sharing`` is on, puts a gate in front of Dask's check: it reads
the worker as :func:`~dask_hoplite.worker.shared_pages.process_memory` does
(what the worker's own memory manager reads too) and calls Dask's check only
when that reading is past the threshold as well. Dask's check then decides,
logs and restarts as it always has. Where the reading is not available (not
Linux), or this ``distributed`` has no such monitor, nothing changes.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from distributed.diagnostics.plugin import NannyPlugin
from tornado.ioloop import PeriodicCallback

from dask_hoplite.worker.shared_pages import process_memory

logger = logging.getLogger(__name__)

#: The key of Dask's memory monitor in ``Nanny.periodic_callbacks``.
MONITOR = "memory_monitor"


def gated_monitor(manager: Any, nanny: Any) -> None:
    """Dask's ``manager.memory_monitor(nanny)``, called only if the worker's
    memory with shared pages at their share is past the terminate threshold
    (or cannot be read)."""
    process = getattr(getattr(nanny, "process", None), "process", None)
    pid = getattr(process, "pid", None)
    limit = getattr(manager, "memory_limit", None)
    fraction = getattr(manager, "memory_terminate_fraction", False)
    if pid is not None and limit and fraction is not False:
        memory = process_memory(pid)
        if memory is not None and memory / limit <= fraction:
            return
    manager.memory_monitor(nanny)


class HopliteNanny(NannyPlugin):
    """Swaps the nanny's memory monitor for :func:`gated_monitor` at
    :meth:`setup`, and back at :meth:`teardown`. The worker is not
    restarted for it."""

    name = "hoplite-nanny"
    restart = False

    def __init__(self) -> None:
        self._dask_monitor: PeriodicCallback | None = None

    def setup(self, nanny: Any) -> None:
        manager = getattr(nanny, "memory_manager", None)
        callbacks = getattr(nanny, "periodic_callbacks", None)
        dask_monitor = callbacks.get(MONITOR) if isinstance(callbacks, dict) else None
        if not isinstance(dask_monitor, PeriodicCallback) or not hasattr(manager, "memory_monitor"):
            # No memory limit or terminate threshold: no monitor to gate.
            logger.debug("%s: no nanny memory monitor to gate", nanny)
            return
        assert isinstance(callbacks, dict)
        gated = PeriodicCallback(partial(gated_monitor, manager, nanny), dask_monitor.callback_time)
        running = dask_monitor.is_running()
        dask_monitor.stop()
        callbacks[MONITOR] = gated
        self._dask_monitor = dask_monitor
        if running:
            gated.start()

    def teardown(self, nanny: Any) -> None:
        dask_monitor, self._dask_monitor = self._dask_monitor, None
        callbacks = getattr(nanny, "periodic_callbacks", None)
        if dask_monitor is None or not isinstance(callbacks, dict):
            return
        gated = callbacks.get(MONITOR)
        running = gated is not None and gated.is_running()
        if gated is not None:
            gated.stop()
        callbacks[MONITOR] = dask_monitor
        if running:
            dask_monitor.start()
