"""Per-receiver timelines of the keys this worker fetched (for benchmarks and
debugging a slow transfer).

With ``hoplite.timelines`` on, each fetch of a large key records when this
worker asked the directory, which sender it was given and when, when each
stream started and ended, and the bytes in hand every
``hoplite.timeline-interval`` while a stream runs; the last 64 keys are kept. ``benchmarks/timeline.py`` collects
them from every worker (``client.run(timeline_of, key)``) and prints one
broadcast's timeline per receiver. Off (the default), nothing is recorded.

Times are ``time.time()`` (one clock for the worker processes of one host).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from dask.typing import Key


class Timelines:
    """The recorded timelines, by key: lists of ``(time, event, detail)``."""

    def __init__(self, keys: int = 64, interval: float = 0.05) -> None:
        self.keys = keys
        self.interval = interval
        self._log: OrderedDict[Key, list[tuple[float, str, dict[str, Any]]]] = OrderedDict()
        #: The sampling task of each key being received, and how many streams use it.
        self._sampling: dict[Key, tuple[asyncio.Task[None], int]] = {}

    def record(self, key: Key, event: str, **detail: Any) -> None:
        """Append ``event`` (with ``detail``) to ``key``'s timeline, now."""
        log = self._log.get(key)
        if log is None:
            log = self._log[key] = []
            while len(self._log) > self.keys:
                self._log.popitem(last=False)
        log.append((time.time(), event, detail))

    @contextlib.contextmanager
    def sampling(self, key: Key, progress: Callable[[], int]) -> Iterator[None]:
        """While the body runs, record ``progress()`` (the bytes of ``key`` in
        hand) every ``interval``: once per key, however many streams (byte
        ranges) fill it at once."""
        task, users = self._sampling.get(key) or (None, 0)
        if task is None:
            task = asyncio.ensure_future(self._sample(key, progress))
        self._sampling[key] = (task, users + 1)
        try:
            yield
        finally:
            task, users = self._sampling[key]
            if users == 1:
                del self._sampling[key]
                task.cancel()
                self.record(key, "bytes", n=progress())
            else:
                self._sampling[key] = (task, users - 1)

    async def _sample(self, key: Key, progress: Callable[[], int]) -> None:
        while True:
            self.record(key, "bytes", n=progress())
            await asyncio.sleep(self.interval)

    def get(self, key: Key) -> list[tuple[float, str, dict[str, Any]]]:
        return list(self._log.get(key, ()))


def timeline_of(key: Key, dask_worker: Any) -> list[tuple[float, str, dict[str, Any]]]:
    """For ``client.run(timeline_of, key)``: worker ``dask_worker``'s timeline
    of ``key`` (empty where hoplite or its timelines are off)."""
    plugin = dask_worker.plugins.get("hoplite-worker")
    parts = getattr(plugin, "_parts", None)
    timelines = getattr(getattr(parts, "ctx", None), "timelines", None)
    return timelines.get(key) if timelines is not None else []
