"""Recycled memory for receiving buffers (see :class:`BufferPool`).

Pure bookkeeping over anonymous memory maps: no event loop, no sockets. The
block store (:mod:`dask_hoplite.core.store`) allocates every receiving buffer
here; a worker trims idle regions periodically (``hoplite.buffer-pool-idle``).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

#: ``hoplite.buffer-pool-reserve: auto`` reserves this fraction of the
#: worker's memory limit (of the host's memory where it has none) ...
AUTO_RESERVE_FRACTION = 1 / 16
#: ... at most this much, the size of object it serves first ...
AUTO_RESERVE_MAX = 256 * 2**20
#: ... and nothing when that comes to less than this: a worker that small
#: moves no object worth a reserve.
AUTO_RESERVE_MIN = 64 * 2**20


def auto_reserve(memory_limit: int | None, host_memory: int) -> int:
    """The bytes ``hoplite.buffer-pool-reserve: auto`` reserves on a worker
    with ``memory_limit`` (None or 0: no limit) on a host of ``host_memory``
    bytes: whole MiB, between :data:`AUTO_RESERVE_MIN` and
    :data:`AUTO_RESERVE_MAX`, or 0."""
    budget = memory_limit if memory_limit else host_memory
    size = min(int(budget * AUTO_RESERVE_FRACTION), AUTO_RESERVE_MAX)
    size -= size % BufferPool.GRANULE
    return size if size >= AUTO_RESERVE_MIN else 0


class BufferPool:
    """Recycles the memory of receiving buffers.

    Fresh anonymous memory must be faulted in and zeroed by the kernel as the
    socket fills it; on a small host that costs as much CPU as the network
    stack itself (measured: ~0.2 s per 256 MiB, more than half a core at
    1 Gbit/s for a relay). Hoplite's object store is a preallocated pool for
    the same reason. Here a region goes back to the pool once nothing refers
    to its bytes any more: every consumer (the deserialised object included)
    reaches them through memoryviews exported by one handle array, and a
    ``weakref.finalize`` on that handle returns the region when it dies.

    Parameters
    ----------
    capacity:
        Bytes of idle regions kept for reuse (``hoplite.buffer-pool-bytes``);
        beyond it regions are unmapped. 0 disables reuse.
    on_fresh:
        Called with every freshly mapped region, before it is used (the
        worker's :class:`~dask_hoplite.worker.prefault.Prefaulter` faults it
        in off the receiving thread); must not block.
    """

    GRANULE = 2**20  # regions are whole MiB, so same-size objects match

    def __init__(self, capacity: int, on_fresh: Callable[[mmap.mmap], None] | None = None) -> None:
        self.capacity = capacity
        self.on_fresh = on_fresh
        self._idle: list[mmap.mmap] = []
        self._since: dict[int, float] = {}  # id(region) -> when it became idle
        # Regions whose handle died, not yet filed into ``_idle``. The
        # finalizer only appends here (atomic, takes no lock): a handle can
        # die in a garbage collection triggered by an allocation made while
        # this very thread holds ``_lock``, and a finalizer that took the
        # (non-reentrant) lock would then wait on itself for ever.
        self._returned: collections.deque[tuple[mmap.mmap, float]] = collections.deque()
        self._lock = threading.Lock()
        self.reused = 0
        self.allocated = 0
        #: ids of the regions mapped by :meth:`reserve`: kept for ever, and
        #: lent to objects smaller than themselves.
        self._reserve: set[int] = set()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            self._file_returned()
            return sum(len(r) for r in self._idle)

    def reserve(self, nbytes: int, regions: int = 1) -> None:
        """Map ``regions`` idle regions of ``nbytes`` each ahead of need (the
        ``on_fresh`` hook faults them in in the background), so that the
        first transfers of a fresh worker find warm memory. A reserved region
        is never trimmed or evicted, and serves any object up to its size
        (the rest of it idles meanwhile)."""
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        for _ in range(regions if size > 0 else 0):
            region = self._map(size)
            with self._lock:
                self._reserve.add(id(region))
                self._idle.append(region)

    def allocate(self, nbytes: int) -> np.ndarray:
        """An uninitialised byte array of exactly ``nbytes``."""
        if nbytes < self.GRANULE:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        region = None
        with self._lock:
            self._file_returned()
            fits = [
                i
                for i, r in enumerate(self._idle)
                if size <= len(r) <= size + size // 4 or (id(r) in self._reserve and size <= len(r))
            ]
            if fits:
                region = self._idle.pop(min(fits, key=lambda i: len(self._idle[i])))
                self._since.pop(id(region), None)
                self.reused += 1
        if region is None:
            # Anonymous mmap, not np.empty: numpy advises huge pages for large
            # arrays, and with THP defrag "madvise" a fault may then compact
            # memory synchronously.
            region = self._map(size)
            self.allocated += 1
        # The handle is the only exporter of the region's bytes: a ctypes
        # array over the mmap. Every numpy array and memoryview derived from
        # the returned array (numpy collapses view bases only through
        # ndarrays, and a memoryview of a memoryview refers to the original
        # exporter) keeps the handle alive, so the region goes back to the
        # pool only when nothing can read or write it any more. (A numpy view
        # of an ndarray over the mmap would not do: its base collapses to the
        # mmap itself, which consumers such as Dask's deserialisation then
        # export directly, and the region would be reused under them.)
        handle = (ctypes.c_char * nbytes).from_buffer(region)
        weakref.finalize(handle, self._give_back, region)
        return np.frombuffer(handle, dtype=np.uint8)  # type: ignore[call-overload]

    def _map(self, size: int) -> mmap.mmap:
        """A fresh region, handed to ``on_fresh``."""
        region = mmap.mmap(-1, size)
        if self.on_fresh is not None:
            self.on_fresh(region)
        return region

    def _give_back(self, region: mmap.mmap) -> None:
        # Runs as a finalizer, possibly inside a locked section of this same
        # thread: no lock here (see ``_returned``).
        self._returned.append((region, time.monotonic()))
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """Move returned regions into the idle list and unmap the oldest idle
        regions beyond ``capacity``. Called with ``_lock`` held; only filing
        adds idle regions, so with nothing returned there is nothing to do."""
        if not self._returned:
            return
        while self._returned:
            region, since = self._returned.popleft()
            self._idle.append(region)
            self._since[id(region)] = since
        evictable = [r for r in self._idle if id(r) not in self._reserve]
        total = sum(len(r) for r in evictable)
        for old in evictable:  # oldest first
            if total <= self.capacity:
                break
            self._idle.remove(old)
            self._since.pop(id(old), None)
            total -= len(old)

    def trim(self, max_idle: float, now: float | None = None) -> int:
        """Unmap regions idle for longer than ``max_idle`` seconds, so that a
        worker's memory returns to its level before a burst of transfers.
        Returns the bytes released."""
        now = time.monotonic() if now is None else now
        freed = 0
        with self._lock:
            self._file_returned()
            keep = []
            for r in self._idle:
                if id(r) not in self._reserve and now - self._since.get(id(r), now) > max_idle:
                    self._since.pop(id(r), None)
                    freed += len(r)
                else:
                    keep.append(r)
            self._idle = keep
        return freed

    def clear(self) -> None:
        with self._lock:
            self._returned.clear()
            self._idle.clear()
            self._since.clear()
            self._reserve.clear()
