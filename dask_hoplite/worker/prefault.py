"""Receive memory faulted in off the critical path (see :class:`Prefaulter`).

A fresh receiving buffer is anonymous memory that the kernel maps and zeroes
page by page at first touch. Left to the socket, that work runs on the thread
that receives: ~0.15 s of kernel time per 256 MiB, in the middle of the first
transfer of each size (the buffer pool recycles memory after that). Here a
helper thread populates every fresh region ahead of the socket, front to back
in chunks, with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) called through
ctypes, which releases the GIL: the zeroing overlaps the wait for the network
instead of adding to it. Where the call is not supported the prefaulter turns
itself off and the kernel faults pages in at first touch as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import queue
import sys
import threading
import time

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h
#: Regions smaller than this are left to the kernel: their faults are cheap.
MIN_BYTES = 8 * 2**20
#: One madvise call covers this much, so the socket never waits long on a
#: chunk the helper is still populating.
CHUNK_BYTES = 8 * 2**20


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


class Prefaulter:
    """A daemon thread that populates fresh memory regions handed to it.

    ``submit`` is the buffer pool's hook for every freshly mapped region
    (:class:`dask_hoplite.core.buffer_pool.BufferPool`, ``on_fresh``); it
    never blocks. ``populated`` counts the bytes populated so far."""

    def __init__(self) -> None:
        self._fn = _madvise()
        self.enabled = self._fn is not None
        self.populated = 0
        #: Bytes submitted and not yet populated (nor given up on).
        self.pending = 0
        self._queue: queue.SimpleQueue[mmap.mmap | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, region: mmap.mmap) -> None:
        if not self.enabled or len(region) < MIN_BYTES:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="hoplite-prefault", daemon=True
                )
                self._thread.start()
            self.pending += len(region)
        self._queue.put(region)

    async def settled(self, timeout: float) -> bool:
        """Wait, without blocking the event loop, until every region submitted
        so far is populated, for at most ``timeout`` seconds; whether it was."""
        deadline = time.monotonic() + timeout
        while self.pending > 0:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def close(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            region = self._queue.get()
            if region is None:
                return
            size = len(region)
            try:
                with contextlib.suppress(ValueError, TypeError):  # closed under us
                    self._populate(region)
            finally:
                # Not kept while waiting for the next region: this frame
                # would hold the worker's last fresh region for the rest of
                # its life, long after the pool trimmed it (each receiver
                # stayed one object above the source when idle).
                del region
                with self._lock:
                    self.pending -= size

    def _populate(self, region: mmap.mmap) -> None:
        assert self._fn is not None
        anchor = ctypes.c_char.from_buffer(region)  # keeps the mapping alive
        try:
            base = ctypes.addressof(anchor)
            for off in range(0, len(region), CHUNK_BYTES):
                n = min(CHUNK_BYTES, len(region) - off)
                if self._fn(base + off, n, MADV_POPULATE_WRITE) != 0:
                    err = ctypes.get_errno()
                    logger.info("prefaulting receive memory is off: madvise: %s", os.strerror(err))
                    self.enabled = False
                    return
                self.populated += n
        finally:
            del anchor
