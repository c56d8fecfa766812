"""Collective tasks that stop when their key is cancelled.

Dask does not stop a running task whose key the client cancelled: the task
goes on to the end and its result is dropped. A reduce tree would go on
streaming and hold its buffers on every worker until then. The collectives'
coroutine tasks (planning tasks, a reduction's result task, an allreduce's
outputs) run here under their key (:meth:`RunningTasks.run`); when the
scheduler forgets such a key while it runs (nothing wants it any more), the
scheduler part tells this worker (stream op ``hoplite-cancel``) and the task
is cancelled: a reduce tree's root then aborts its nodes and drops their
partial results (:class:`~dask_hoplite.worker.reduce_root.TreeRoot`). Dask
sees the task fail with :class:`~dask_hoplite.errors.CollectiveAborted`, in
its cancelled state, and forgets it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from dask.typing import Key

from dask_hoplite.core.protocol import CANCEL_OP
from dask_hoplite.errors import CollectiveAborted

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["CANCEL_OP", "RunningTasks"]


class RunningTasks:
    """This worker's running collective tasks, by key."""

    def __init__(self) -> None:
        self._running: dict[Key, asyncio.Task[Any]] = {}
        self._cancelled: set[Key] = set()

    async def run(self, key: Key | None, coro: Coroutine[Any, Any, T]) -> T:
        """``coro``'s result, run as task ``key`` (None: not cancellable)."""
        if key is None:
            return await coro
        inner = asyncio.ensure_future(coro)
        self._running[key] = inner
        try:
            return await inner
        except asyncio.CancelledError:
            if key in self._cancelled:
                raise CollectiveAborted(f"{key!r} was cancelled") from None
            inner.cancel()  # Dask cancelled the task itself (the worker closes)
            raise
        finally:
            if self._running.get(key) is inner:
                del self._running[key]
            self._cancelled.discard(key)

    def cancel(self, key: Key, **kwargs: Any) -> None:
        """Stream op ``hoplite-cancel``: stop task ``key`` if it runs here."""
        inner = self._running.get(key)
        if inner is None or inner.done():
            return
        logger.info("cancelling %r: its key was cancelled", key)
        self._cancelled.add(key)
        inner.cancel()

    def close(self) -> None:
        """The worker part is torn down: stop every task."""
        for key in list(self._running):
            self.cancel(key)
