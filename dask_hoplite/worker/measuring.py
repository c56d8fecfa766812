"""Measuring the results Dask cannot size, as their tasks finish here.

A task's result whose type Dask has no sizing rule for
(:func:`~dask_hoplite.core.measured_sizes.sizeof_may_be_wrong`) and whose
estimate is under ``hoplite.min-bytes`` is serialised once, when its task
finishes on this worker. If the serialised size reaches ``min-bytes``:

* the frames are kept in the block store, so every stream of the key is
  served from them (the object is serialised once, not once per receiver);
* the scheduler is told (``hoplite-measured``) before Dask's own report that
  the task finished, on the same ordered stream: it plans with that size,
  and tells each worker that gets a task needing the key (``hoplite-sizes``)
  before that task reaches it, so the worker's fetch goes through hoplite.

Results that measure small are dropped at once; their fetches stay Dask's,
with no extra round trip. ``hoplite.measure-unsized: false`` turns it off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dask.typing import Key
from distributed.utils import nbytes

from dask_hoplite.core.measured_sizes import MEASURED_OP, sizeof_may_be_wrong
from dask_hoplite.worker.context import WorkerContext, serialize_for_streams

logger = logging.getLogger(__name__)

#: Dask's states of a task that computed its key here.
_COMPUTED = frozenset({"executing", "long-running", "resumed"})


class SizeMeasuring:
    """Measures this worker's unsized results and learns of others' (the
    sizes it learns are in ``ctx.measured``, read by ``ctx.is_large``)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    def transition(self, key: Key, start: str, finish: str) -> None:
        """Dask moved ``key`` from ``start`` to ``finish`` on this worker."""
        if finish == "forgotten":
            self.ctx.measured.pop(key, None)
        elif finish == "memory" and start in _COMPUTED and self.ctx.config.measure_unsized:
            self._measure(key)

    def _measure(self, key: Key) -> None:
        ctx = self.ctx
        w = ctx.worker
        ts = w.state.tasks.get(key)
        if ts is None or (ts.nbytes or 0) >= ctx.config.min_bytes or key in ctx.store:
            return
        try:
            value = w.data[key]
        except KeyError:
            return
        if not sizeof_may_be_wrong(value):
            return
        try:
            # On the event loop, before Dask reports the task finished: the
            # report must reach the scheduler first. Dask would serialise the
            # object here too, once for every peer that fetches it.
            header, frames = serialize_for_streams(value)
        except Exception as e:
            logger.debug("%r could not be measured: %s", key, e)
            return
        n = sum(nbytes(f) for f in frames)
        ctx.measured.pop(key, None)
        if n < ctx.config.min_bytes:
            return
        ctx.store.add_source(key, header, frames)
        ctx.measured[key] = n
        ctx.count("keys-measured")
        logger.debug("%r: Dask sizes it at %d bytes, serialised it is %d", key, ts.nbytes, n)
        ctx.send({"op": MEASURED_OP, "key": key, "nbytes": n})

    def learned(self, sizes: Iterable[tuple[Key, int]] = (), **kwargs: Any) -> None:
        """Stream ``hoplite-sizes``: keys a task sent here next needs, as their
        holders measured them."""
        for key, n in sizes:
            self.ctx.measured[key] = int(n)
