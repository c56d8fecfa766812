"""One copy per host, on a worker (issue 42): large keys received into shared
regions, and taken from a worker of the same host by mapping its region.

The directory sends a receiver to a holder on its own host whenever the key
is there or on its way in (a key enters a host once). When its answer says
the receiver's host runs more than one worker:

- the receiver that streams the key receives it into a
  :class:`~dask_hoplite.worker.memfd_regions.SharedRegion` instead of the
  buffer pool (:meth:`HostSharing.receive_into_region`), and serves it on
  its :class:`~dask_hoplite.worker.region_handoff.RegionServer` once
  complete;
- a receiver given a sender on its own host first asks that sender's server
  (:meth:`HostSharing.take`), which answers once the key is complete there:
  it maps the region and its buffer is complete at once. A handoff that
  fails, and it streams as before.
- a sender that holds the key outside a region (it computed it, or received
  it before its host ran several workers) copies it into one to hand out
  (:meth:`HostSharing._handout`): a copy within memory, threads faulting in
  the fresh pages side by side, where a stream over loopback would cost the
  same fresh pages plus the socket's copies on both ends. It lets go of that
  copy :data:`LINGER` seconds after its last handoff; the pages live on in
  the workers that map them, which hand them on themselves.

Every task sees a private copy-on-write mapping of the region
(:meth:`HostSharing.task_frames`): a task that writes into its input copies
the pages it touches, in its own process. A region is closed when its buffer
dies (the store released the key and no stream reads it any more); the pages
go with the last worker of the host that maps them.

A worker's server is named after its address (:func:`server_name`); an
abstract socket name belongs to a network namespace, so a name reaches the
workers of that host only.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from dask.typing import Key

from dask_hoplite.core.store import BlockStore, BufferState, Layout, ObjectBuffer
from dask_hoplite.errors import BufferStateError, HandoffFailed, LayoutChanged
from dask_hoplite.worker.memfd_regions import SharedRegion, copy_frames
from dask_hoplite.worker.region_handoff import RegionServer, fetch_region

logger = logging.getLogger(__name__)

#: While a buffer whose region is asked for is interrupted (its own stream
#: resumes from another sender), look again this often.
INTERRUPTED_POLL = 0.05

#: A copy made to hand out a key held outside a region is let go this many
#: seconds after its last handoff. Workers that mapped it keep its pages (and
#: serve them); a worker asking later, which the directory sends to a holder
#: of the host, finds it still here within this time.
LINGER = 5.0


def server_name(address: str) -> str:
    """The region server's name of the worker at ``address``."""
    return f"dask-hoplite/{address}"


def _region_name(key: Key) -> str:
    """The name a region of ``key`` shows in ``/proc/<pid>/maps``."""
    return f"dask-hoplite-{key}"[:200]


def _key(token: Any) -> Key:
    """A key back from the token a request carries (the handoff unpacks
    msgpack arrays as tuples; a key's tuples nest)."""
    if isinstance(token, (list, tuple)):
        return tuple(_key(t) for t in token)
    return token


class RegionAllocator:
    """Receive memory for one buffer in a fresh shared region: what the
    buffer's ``pool`` is set to (``allocate`` is all a buffer asks of it)."""

    def __init__(self, sharing: HostSharing, buf: ObjectBuffer) -> None:
        self._sharing = sharing
        self._buf = weakref.ref(buf)

    def allocate(self, nbytes: int) -> np.ndarray:
        buf = self._buf()
        if buf is None:
            raise BufferStateError("a shared region was asked for a buffer that is gone")
        region = SharedRegion.create(nbytes, _region_name(buf.key))
        memory = np.frombuffer(region.writable, dtype=np.uint8)
        self._sharing.attach(buf, region, memory)
        if region.mapping is not None and self._sharing.prefault is not None:
            self._sharing.prefault(region.mapping)
        return memory


class HostSharing:
    """The regions of one worker's buffers and the server that hands them to
    the workers of its host."""

    def __init__(
        self,
        store: BlockStore,
        address: str,
        prefault: Callable[[mmap.mmap], None] | None = None,
        source: Callable[[Key], Awaitable[ObjectBuffer | None]] | None = None,
    ) -> None:
        self.store = store
        self.address = address
        #: Populates a fresh writable mapping ahead of the socket, or None.
        self.prefault = prefault
        #: The buffer to serve a key from when the store has none yet (the
        #: sender's, which serialises a key Dask holds here), or None.
        self.source = source
        #: The copies made to hand out keys held outside a region, by buffer.
        self._handouts: weakref.WeakKeyDictionary[ObjectBuffer, _Handout] = (
            weakref.WeakKeyDictionary()
        )
        #: Each buffer's region, and the array over it the buffer was given.
        self._regions: weakref.WeakKeyDictionary[ObjectBuffer, tuple[SharedRegion, np.ndarray]] = (
            weakref.WeakKeyDictionary()
        )
        self.server = RegionServer(self._lookup, server_name(address))

    async def start(self) -> HostSharing:
        await self.server.start()
        return self

    def close(self) -> None:
        self.server.close_now()
        for handout in list(self._handouts.values()):
            handout.close()

    # ------------------------------------------------------------ regions

    def attach(self, buf: ObjectBuffer, region: SharedRegion, memory: np.ndarray) -> None:
        """``buf``'s bytes are ``region``'s, through ``memory`` (an array over
        a mapping of it); the region is closed when ``buf`` dies."""
        self._regions[buf] = (region, memory)
        weakref.finalize(buf, region.close)

    def region_of(self, buf: ObjectBuffer) -> SharedRegion | None:
        """The open region ``buf``'s bytes are in, if they still are: a
        buffer that adopted a copy computed here holds other bytes now."""
        found = self._regions.get(buf)
        if found is None or found[0].closed or buf.memory is not found[1]:
            return None
        return found[0]

    def receive_into_region(self, buf: ObjectBuffer) -> None:
        """Receive ``buf`` (not allocated yet) into a shared region."""
        if buf.layout is None and not isinstance(buf.pool, RegionAllocator):
            buf.pool = RegionAllocator(self, buf)  # type: ignore[assignment]

    def task_frames(self, buf: ObjectBuffer) -> list[memoryview]:
        """The frames a task's object is made of: for a buffer in a region,
        views of a private mapping of it (sealed first, once complete)."""
        region = self._sealed_region(buf)
        if region is None or buf.layout is None:
            return buf.frames()
        private = region.private()
        return [private[a:b] for a, b in buf.layout.frame_bounds()]

    def _sealed_region(self, buf: ObjectBuffer) -> SharedRegion | None:
        """The region of ``buf``, complete, sealed (now, the first time it is
        asked for), or None."""
        region = self.region_of(buf)
        if region is None or buf.state is not BufferState.COMPLETE:
            return None
        if not region.sealed:
            region.seal()
        return region

    # ------------------------------------------------------------ handoff

    async def take(self, buf: ObjectBuffer, sender: str, timeout: float) -> bool:
        """Fill ``buf`` (nothing received yet) by mapping the region of
        ``sender``, a worker of this host, once complete there: True if it is
        complete now. ``timeout``: seconds without a word from ``sender``'s
        server before giving up on it (a stopped process)."""
        try:
            region = await fetch_region(server_name(sender), buf.key, timeout)
        except HandoffFailed as e:
            logger.debug("%r: no region from %s (%s); streaming", buf.key, sender, e)
            return False
        if region is None:
            return False
        try:
            layout = Layout.from_msg(dict(region.meta.get("layout") or {}))
            if layout.nbytes != region.nbytes:
                raise ValueError(f"{region.nbytes} bytes for a layout of {layout.nbytes}")
            if buf.layout is not None or buf.state is not BufferState.PENDING:
                raise ValueError(f"its buffer here is {buf.state.value} already")
            memory = np.frombuffer(region.private(), dtype=np.uint8)
            buf.allocate(layout, memory=memory)
        except (ValueError, TypeError, LayoutChanged) as e:
            logger.info("%r: the region from %s is unusable (%s); streaming", buf.key, sender, e)
            region.close()
            return False
        self.attach(buf, region, memory)
        if layout.nbytes:
            buf.advance(layout.nbytes)
        return True

    async def _lookup(self, token: Any) -> SharedRegion | None:
        """The sealed region of the key named ``token``, once every byte of it
        is here (a copy made now if it is held outside a region); None if
        this worker does not hold it, or fails to."""
        key = _key(token)
        while True:
            buf = self.store.get(key)
            if buf is None and self.source is not None:
                buf = await self.source(key)
            if buf is None or buf.state is BufferState.FAILED:
                return None
            if buf.state is BufferState.COMPLETE:
                break
            if buf.interrupted is not None:
                await asyncio.sleep(INTERRUPTED_POLL)
                continue
            await _settled(buf)
        if buf.layout is None:
            return None
        region = self._sealed_region(buf)
        if region is None:
            region = await self._handout(buf)
        if region is not None:
            region.meta = {"layout": buf.layout.to_msg()}
        return region

    async def _handout(self, buf: ObjectBuffer) -> SharedRegion | None:
        """A sealed copy of complete ``buf`` in a region of its own, made
        once for every request that comes while it lives; None if it
        cannot be made."""
        handout = self._handouts.get(buf)
        if handout is None or handout.closed:
            handout = self._handouts[buf] = _Handout(buf)
            weakref.finalize(buf, handout.close)
        try:
            return await handout.region()
        except (OSError, ValueError, BufferStateError) as e:
            logger.info("%r: no region copy to hand out (%s); the peer streams", buf.key, e)
            return None


class _Handout:
    """A copy of one complete buffer in a shared region, made to hand out:
    made by the first request, shared by the others, closed :data:`LINGER`
    seconds after the last (or with the buffer)."""

    def __init__(self, buf: ObjectBuffer) -> None:
        self.closed = False
        self._made = asyncio.ensure_future(self._make(buf.key, buf.frames()))
        self._timer: asyncio.TimerHandle | None = None

    @staticmethod
    async def _make(key: Key, frames: list[memoryview]) -> SharedRegion:
        region = SharedRegion.create(sum(f.nbytes for f in frames), _region_name(key))
        try:
            await asyncio.to_thread(copy_frames, region.writable, frames)
            region.seal()
        except BaseException:
            region.close()
            raise
        return region

    async def region(self) -> SharedRegion | None:
        region = await asyncio.shield(self._made)
        if self.closed:
            return None
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(LINGER, self.close)
        return region

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._made.done():
            _close_made(self._made)
        else:
            self._made.add_done_callback(_close_made)


def _close_made(made: asyncio.Future[SharedRegion]) -> None:
    """Close the region ``made`` made, if it made one."""
    if not made.cancelled() and made.exception() is None:
        made.result().close()


def _settled(buf: ObjectBuffer) -> asyncio.Future[None]:
    """Done when ``buf`` completes, fails or is interrupted."""
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def wake(_buf: ObjectBuffer) -> None:
        if not fut.done():
            fut.set_result(None)

    buf.when(2**62, wake)
    return fut
