"""One object's bytes in memory that the workers of one host can share
(issue 42: one copy per host).

A :class:`SharedRegion` is a ``memfd``: anonymous memory behind a file
descriptor. The worker that receives an object over the network writes it
through a shared mapping; every other worker on its host gets the descriptor
(:mod:`dask_hoplite.worker.region_handoff`) and maps the same pages, so the
host holds the object once. The kernel frees the pages when the last
descriptor and mapping close, so a worker that crashes leaks nothing: there is
no name in ``/dev/shm`` to clean up.

What a task sees is always a *private* mapping (``MAP_PRIVATE``,
copy-on-write): a task that writes into its input copies only the pages it
touches, in its own process, and changes nothing that another worker reads.
Arrays stay writable, as they are in Dask.

Once complete a region is sealed (:meth:`SharedRegion.seal`): no shared
writable mapping can be made any more and ``write`` on the descriptor fails,
so no worker that received it can change it for the others. The writer's own
mapping stays writable (``F_SEAL_FUTURE_WRITE``, Linux 5.1), which lets it seal
while streams still read from that mapping; it is closed with the region.

No event loop, no sockets: the receiver and the handoff call these.
:func:`available` says whether this platform has memfds and seals; where it
does not, objects travel and are held as before.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

#: ``F_SEAL_FUTURE_WRITE`` (Linux 5.1, ``linux/fcntl.h``); Python's fcntl
#: does not name it.
F_SEAL_FUTURE_WRITE = 0x0010

#: The seals of a complete region: its size is fixed, and no one can write to
#: it through its descriptor or a new shared mapping, or change the seals.
SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE

#: Threads that fill a fresh region from memory this process holds
#: (:func:`copy_frames`). The kernel allocates and zeroes a fresh page at its
#: first write, which costs several times the copy itself (measured on this
#: project's 2-core VM: 0.73 s per GiB with one thread, 0.38-0.42 s with two,
#: no better with three or four); threads fault their pages in side by side.
COPY_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)

#: Pieces smaller than this are not worth a thread of their own.
_MIN_PIECE = 16 * 2**20


def available() -> bool:
    """Whether this process can make, seal and map shared regions (Linux
    5.1 or later with memfd support; not, say, on macOS or Windows)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    try:
        with SharedRegion.create(mmap.PAGESIZE, "dask-hoplite-probe") as probe:
            probe.seal()
    except OSError:  # no memfd here, or a kernel without F_SEAL_FUTURE_WRITE
        return False
    return True


def copy_frames(
    dest: memoryview, frames: Sequence[memoryview], threads: int = COPY_THREADS
) -> None:
    """Copy ``frames`` end to end into ``dest`` (exactly their size), with up
    to ``threads`` threads, each filling one stretch of ``dest``. numpy's
    copy releases the GIL, so the threads fault in and copy in parallel."""
    out = np.frombuffer(dest, dtype=np.uint8)
    sources = [np.frombuffer(f, dtype=np.uint8) for f in frames]
    total = sum(len(a) for a in sources)
    if total != len(out):
        raise ValueError(f"{total} bytes of frames for a region of {len(out)}")
    n = max(1, min(threads, total // _MIN_PIECE))
    stretch = -(-total // n)  # each thread's bytes of ``dest``
    bounds = [(t * stretch, min(total, (t + 1) * stretch)) for t in range(n)]
    pieces: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in bounds]
    offset = 0
    for a in sources:  # a frame goes to every thread whose stretch it crosses
        for piece, (lo, hi) in zip(pieces, bounds, strict=True):
            a0, a1 = max(lo, offset), min(hi, offset + len(a))
            if a0 < a1:
                piece.append((a[a0 - offset : a1 - offset], out[a0:a1]))
        offset += len(a)

    def fill(piece: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for src, dst in piece:
            np.copyto(dst, src)

    if len(pieces) <= 1:
        for piece in pieces:
            fill(piece)
        return
    errors: list[BaseException] = []

    def run(piece: list[tuple[np.ndarray, np.ndarray]]) -> None:
        try:
            fill(piece)
        except BaseException as e:  # reraised by the caller's thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(p,), daemon=True) for p in pieces[1:]]
    for t in workers:
        t.start()
    run(pieces[0])
    for t in workers:
        t.join()
    if errors:
        raise errors[0]


class SharedRegion:
    """``nbytes`` of memfd memory, owned by this process through ``fd``.

    Made by the receiving worker with :meth:`create`, filled through
    :attr:`writable`, then :meth:`seal`-ed; received by another worker of
    the host with :meth:`from_fd`. Either reads it through :meth:`private`.
    :meth:`close` lets go of this process's descriptor and writable mapping;
    a private mapping lives as long as the objects that view it."""

    def __init__(self, fd: int, nbytes: int, name: str, writable: mmap.mmap | None) -> None:
        self.fd = fd
        self.nbytes = nbytes
        self.name = name
        self._writable = writable
        self.closed = False
        #: What the holder says of the region's contents (a store's layout
        #: of the object in it), handed along with it to another worker.
        self.meta: dict[str, Any] = {}

    @classmethod
    def create(cls, nbytes: int, name: str) -> SharedRegion:
        """A fresh, zeroed, writable region of ``nbytes`` (``name`` shows in
        ``/proc/<pid>/maps`` as ``/memfd:<name>``, for a person reading them)."""
        if nbytes < 0:
            raise ValueError(f"a shared region cannot have {nbytes} bytes")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            writable = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, _READ_WRITE) if nbytes else None
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, name, writable)

    @classmethod
    def from_fd(cls, fd: int, name: str = "") -> SharedRegion:
        """The region behind ``fd``, received from another worker; this object
        owns ``fd`` from now on. Raises ValueError if the region is not sealed
        (its sender could still change it under this worker's tasks)."""
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & SEALS != SEALS:
                raise ValueError(f"shared region {name!r} is not sealed (seals {seals:#x})")
            nbytes = os.fstat(fd).st_size
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, nbytes, name, None)

    @property
    def writable(self) -> memoryview:
        """The region's bytes, writable by this process and seen by every
        mapping of the region: only the worker that created it has this."""
        if self._writable is None:
            if self.nbytes == 0 and not self.closed:
                return memoryview(bytearray())
            raise ValueError(f"shared region {self.name!r} is not writable here")
        return memoryview(self._writable)

    @property
    def mapping(self) -> mmap.mmap | None:
        """The writable shared mapping itself (to populate it ahead of the
        writes, say), or None in a worker that did not create the region."""
        return self._writable

    @property
    def sealed(self) -> bool:
        return fcntl.fcntl(self.fd, fcntl.F_GET_SEALS) & SEALS == SEALS

    def seal(self) -> None:
        """Forbid every further change but through this process's own
        writable mapping: call when every byte has arrived."""
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)

    def private(self) -> memoryview:
        """A copy-on-write view of the region, for a task: a write copies
        the page it touches into this process and changes nothing else. The
        mapping lives until the last view of it dies; the region's own
        :meth:`close` does not end it."""
        if self.closed:
            raise ValueError(f"shared region {self.name!r} is closed")
        if self.nbytes == 0:
            return memoryview(bytearray())
        return memoryview(mmap.mmap(self.fd, self.nbytes, mmap.MAP_PRIVATE, _READ_WRITE))

    def close(self) -> None:
        """Let go of the descriptor and the writable mapping. The pages live
        on while another descriptor or mapping (here or in another worker)
        holds them. A writable mapping still viewed (a stream reading from
        it, say) is left to close when its last view dies."""
        if self.closed:
            return
        self.closed = True
        if self._writable is not None:
            try:
                self._writable.close()
            except BufferError:  # still exported: unmapped with its last view
                pass
            self._writable = None
        os.close(self.fd)

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd {self.fd}"
        return f"<SharedRegion {self.name!r} {self.nbytes} bytes, {state}>"
