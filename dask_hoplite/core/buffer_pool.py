"""Recycled memory for receiving buffers (see :class:`BufferPool`).

Pure bookkeeping over anonymous memory maps: no event loop, no sockets. The
block store (:mod:`dask_hoplite.core.store`) allocates every receiving buffer
here; a worker trims idle regions periodically (``hoplite.buffer-pool-idle``).
"""

from __future__ import annotations

import bisect
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
    clock:
        Seconds, for how long regions and the pool have been idle.
    spare:
        Map a spare region beside the first one of each size to come back in
        a burst (:meth:`_add_spare`).
    """

    GRANULE = 2**20  # regions are whole MiB, so same-size objects match

    def __init__(
        self,
        capacity: int,
        on_fresh: Callable[[mmap.mmap], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        spare: bool = False,
    ) -> None:
        self.capacity = capacity
        self.spare = spare
        self.on_fresh = on_fresh
        self._clock = clock
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
        #: When a buffer was last handed out (a burst of transfers runs
        #: while this is recent).
        self._last_use = clock()
        #: Region sizes given a spare in the current burst (:meth:`_add_spare`).
        self._spared: set[int] = set()
        #: The regions mapped by :meth:`reserve`, kept for ever and carved
        #: into extents: each one's free extents, (offset, length) sorted by
        #: offset, adjacent ones merged (:class:`ReserveExtents`).
        self._reserve: list[tuple[mmap.mmap, ReserveExtents]] = []
        #: Extents whose handle died, not yet merged back (as ``_returned``).
        self._returned_extents: collections.deque[tuple[ReserveExtents, int, int]] = (
            collections.deque()
        )

    @property
    def idle_bytes(self) -> int:
        """Bytes mapped and lent to nobody: idle regions and the reserve's
        free extents."""
        with self._lock:
            self._file_returned()
            free = sum(extents.free_bytes for _, extents in self._reserve)
            return sum(len(r) for r in self._idle) + free

    def reserve(self, nbytes: int, regions: int = 1) -> None:
        """Map ``regions`` regions of ``nbytes`` each ahead of need (the
        ``on_fresh`` hook faults them in in the background), so that the
        first transfers of a fresh worker find warm memory. A reserved region
        is never trimmed or evicted; objects take whole-MiB extents of it,
        smallest free extent that fits first, and give them back when they
        die (so a 256 MiB reserve holds two 128 MiB objects at once, or one
        of 256 MiB)."""
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        for _ in range(regions if size > 0 else 0):
            region = self._map(size)
            with self._lock:
                self._reserve.append((region, ReserveExtents(size)))

    def allocate(self, nbytes: int) -> np.ndarray:
        """An uninitialised byte array of exactly ``nbytes``: an extent of
        the reserve where one is free, else an idle region of about the
        size, else freshly mapped memory."""
        if nbytes < self.GRANULE:
            return np.empty(nbytes, dtype=np.uint8)
        size = -(-nbytes // self.GRANULE) * self.GRANULE
        region = None
        offset = 0
        extents = None
        with self._lock:
            self._last_use = self._clock()
            self._file_returned()
            carved = self._carve(size)
            if carved is not None:
                region, extents, offset = carved
            else:
                fits = [i for i, r in enumerate(self._idle) if size <= len(r) <= size + size // 4]
                if fits:
                    # The smallest that fits, the longest idle of those.
                    # (The latest returned instead kept a loop on one region
                    # while the spare was being faulted in beside it: its
                    # first warm repetitions took 1.9-2.0x of S/B at 1 Gbit/s,
                    # against 1.24-1.31x.)
                    region = self._idle.pop(min(fits, key=lambda i: len(self._idle[i])))
                    self._since.pop(id(region), None)
            if region is not None:
                self.reused += 1
        if region is None:
            # Anonymous mmap, not np.empty: numpy advises huge pages for large
            # arrays, and with THP defrag "madvise" a fault may then compact
            # memory synchronously. Huge pages would save little here: the
            # kernel zeroes a fresh page whatever its size (faulting in 1 GiB
            # took 0.55 s in 4 KiB pages and 0.61 s in huge pages on the
            # benchmarks' VM), and row gathers out of the received array ran
            # at the same speed from either.
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
        handle = (ctypes.c_char * nbytes).from_buffer(region, offset)
        if extents is None:
            weakref.finalize(handle, self._give_back, region)
        else:
            weakref.finalize(handle, self._give_back_extent, extents, offset, size)
        return np.frombuffer(handle, dtype=np.uint8)  # type: ignore[call-overload]

    def _carve(self, size: int) -> tuple[mmap.mmap, ReserveExtents, int] | None:
        """The smallest free extent of the reserve that holds ``size`` bytes,
        taken (called with ``_lock`` held)."""
        best = None
        for region, extents in self._reserve:
            length = extents.smallest_fit(size)
            if length is not None and (best is None or length < best[0]):
                best = (length, region, extents)
        if best is None:
            return None
        _, region, extents = best
        return region, extents, extents.take(size)

    def _map(self, size: int) -> mmap.mmap:
        """A fresh region, handed to ``on_fresh``."""
        region = mmap.mmap(-1, size)
        if self.on_fresh is not None:
            self.on_fresh(region)
        return region

    def _give_back(self, region: mmap.mmap) -> None:
        # Runs as a finalizer, possibly inside a locked section of this same
        # thread: no lock here (see ``_returned``).
        self._returned.append((region, self._clock()))
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _give_back_extent(self, extents: ReserveExtents, offset: int, size: int) -> None:
        # A finalizer, as ``_give_back``: no lock.
        self._returned_extents.append((extents, offset, size))
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        """Merge returned extents back into the reserve, move returned
        regions into the idle list and unmap the oldest idle regions beyond
        ``capacity``. Called with ``_lock`` held; only filing adds idle
        regions, so with nothing returned there is nothing to do."""
        while self._returned_extents:
            extents, offset, size = self._returned_extents.popleft()
            extents.give(offset, size)
        if not self._returned:
            return
        while self._returned:
            region, since = self._returned.popleft()
            self._idle.append(region)
            self._since[id(region)] = since
            self._add_spare(len(region), since)
        total = sum(len(r) for r in self._idle)
        for old in list(self._idle):  # oldest first
            if total <= self.capacity:
                break
            self._idle.remove(old)
            self._since.pop(id(old), None)
            total -= len(old)

    def _add_spare(self, size: int, now: float) -> None:
        """The first time a region of ``size`` comes back in a burst, map a
        spare of that size beside it (faulted in by ``on_fresh``, between
        transfers): a loop's next transfer often starts before the previous
        object is freed, and then takes the spare instead of zeroing fresh
        memory on its critical path. Called with ``_lock`` held."""
        if not self.spare or size in self._spared or not self.capacity:
            return
        self._spared.add(size)
        if sum(len(r) for r in self._idle) + size > self.capacity:
            return
        spare = self._map(size)
        self.allocated += 1
        self._idle.append(spare)
        self._since[id(spare)] = now

    def trim(self, max_idle: float, now: float | None = None) -> int:
        """Unmap regions idle for longer than ``max_idle`` seconds once no
        buffer has been handed out for that long either, so that a worker's
        memory returns to its level before a burst of transfers when the
        burst is over. Within a burst, a region idle for a while is the one
        the next late release will need: a loop that starts its next
        transfer before the previous one's object is freed holds two
        buffers at once now and then, and each fresh one costs the kernel's
        zeroing of every page (at 1 Gbit/s on 2 cores, a repetition whose
        receivers all took fresh memory ran at half the rate). Returns the
        bytes released."""
        now = self._clock() if now is None else now
        freed = 0
        with self._lock:
            if now - self._last_use <= max_idle:
                return 0
            self._spared.clear()  # the burst is over
            self._file_returned()
            keep = []
            for r in self._idle:
                if now - self._since.get(id(r), now) > max_idle:
                    self._since.pop(id(r), None)
                    freed += len(r)
                else:
                    keep.append(r)
            self._idle = keep
        return freed

    def clear(self) -> None:
        with self._lock:
            self._returned.clear()
            self._returned_extents.clear()
            self._idle.clear()
            self._since.clear()
            self._spared.clear()
            self._reserve.clear()


class ReserveExtents:
    """The free extents of one reserved region: (offset, length) pairs,
    sorted by offset, no two adjacent (a returned extent merges with its free
    neighbours, so the region's free bytes are as few extents as they can
    be). Bookkeeping only, the bytes are the pool's."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(0, size)]

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self.free)

    def smallest_fit(self, size: int) -> int | None:
        """The length of the smallest free extent of at least ``size``."""
        i = self._smallest(size)
        return None if i is None else self.free[i][1]

    def take(self, size: int) -> int:
        """Take ``size`` bytes from the front of the smallest free extent
        that holds them (there must be one); their offset."""
        i = self._smallest(size)
        assert i is not None, f"no free extent of {size} bytes"
        offset, length = self.free[i]
        if length == size:
            del self.free[i]
        else:
            self.free[i] = (offset + size, length - size)
        return offset

    def _smallest(self, size: int) -> int | None:
        """The index of the smallest free extent of at least ``size``."""
        fits = [i for i, (_, length) in enumerate(self.free) if length >= size]
        return min(fits, key=lambda i: self.free[i][1]) if fits else None

    def give(self, offset: int, size: int) -> None:
        """Give back ``size`` bytes at ``offset`` (taken before), merged with
        the free extents either side."""
        i = bisect.bisect(self.free, (offset, 0))
        if i > 0 and sum(self.free[i - 1]) == offset:  # the one before ends here
            i -= 1
            offset, size = self.free[i][0], self.free[i][1] + size
            del self.free[i]
        if i < len(self.free) and self.free[i][0] == offset + size:  # the next starts here
            size += self.free[i][1]
            del self.free[i]
        self.free.insert(i, (offset, size))
