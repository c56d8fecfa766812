"""Moving blocks over ``distributed.comm``: the sender and receiver loops of
the block-stream protocol (:mod:`dask_hoplite.core.protocol`).

Comms come from the worker's own connection pool, so TLS, ``require_encryption``
and other comm backends apply unchanged. Over TCP and TLS comms the payload
travels in raw mode: written from the source buffer (zero-copy views of a numpy
array, or a relay's partially filled buffer) and read straight into the
receiver's buffer. Other backends use message mode: blocks as out-of-band
frames with acknowledgements for flow control. Every wait is bounded by
``stall_timeout``: a peer that makes no progress for that long is treated as
failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import AsyncIterator
from typing import Any

from distributed.comm.core import Comm
from distributed.core import ConnectionPool
from distributed.protocol import to_serialize
from distributed.utils import wait_for
from tornado.iostream import IOStream

from dask_hoplite.core.protocol import (
    SendWindow,
    StreamRequest,
    parse_ack,
    parse_block,
)
from dask_hoplite.core.store import BufferState, Layout, ObjectBuffer
from dask_hoplite.errors import ProtocolError, SenderBusy, StreamStalled, TransferFailed
from dask_hoplite.timeouts import wait_for_future

logger = logging.getLogger(__name__)

#: Largest single socket write in raw mode (the kernel chops it anyway; one
#: await per chunk keeps the sender responsive to cancellation).
RAW_WRITE_BYTES = 4 * 2**20


def raw_stream(comm: Comm) -> IOStream | None:
    """The tornado stream under a TCP or TLS comm, or None for other backends."""
    stream = getattr(comm, "stream", None)
    return stream if isinstance(stream, IOStream) else None


def forget_frames(error: BaseException) -> None:
    """Cut ``error`` (and the errors it chains, tornado's ``real_error``
    included) from the frames it passed through, clearing their local
    variables: for a stream error that is caught, logged and not raised
    again (its traceback is gone afterwards).

    A stream that breaks in a socket write leaves a reference cycle: tornado's
    write future holds the error, whose traceback holds the frames it passed
    through, one of which holds the future. The frames hold the stream's buffer
    and the views being written, so until a full collection of the cyclic
    garbage collector (which may not come for minutes) the object's memory
    stays mapped after Dask released its key: measured on a LocalCluster, a
    relay whose reader moved to another sender kept its 1 GiB receiving
    region, and the next broadcast there mapped and faulted in a fresh one
    (4.7 s instead of 1.0 s; ``benchmarks/host_memory.py``). The socket's own
    error (tornado's ``StreamClosedError.real_error``) holds tornado's write
    frame, and the handler that caught the error holds the buffer in its own
    frame, which the traceback keeps after the handler returned."""
    todo: list[BaseException] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # the running frames stay as they are
        # ... and the error no longer refers to them: a running frame (the
        # handler that caught it) keeps its locals once it has returned.
        e.__traceback__ = None
        # Tornado's StreamClosedError carries the socket's error apart.
        for chained in (e.__cause__, e.__context__, getattr(e, "real_error", None)):
            if isinstance(chained, BaseException):
                todo.append(chained)


async def _bounded(aw: Any, timeout: float, what: str, peer: str) -> Any:
    try:
        return await wait_for(aw, timeout)
    except asyncio.TimeoutError:
        raise StreamStalled(f"no {what} from/to {peer} for {timeout:g}s") from None


async def connect(pool: ConnectionPool, addr: str, timeout: float) -> Comm:
    """A comm to ``addr`` from ``pool``, within ``timeout``.

    ``ConnectionPool.connect`` bounds only the TCP connect: Dask's handshake
    that follows waits without limit, and a stopped peer's kernel accepts the
    connection and then never answers. A cancelled connect gives its pool
    slot back."""
    return await _bounded(pool.connect(addr), timeout, "handshake", addr)


def drop(pool: ConnectionPool, addr: str, comm: Comm) -> None:
    """Abort ``comm`` (taken from ``pool`` for ``addr``) and give its slot back.

    A comm from ``ConnectionPool.connect`` holds one of the pool's slots (a
    worker's pool has 512) until it is handed to ``reuse``; an aborted comm
    that is not handed back holds its slot for good, and once a worker has
    leaked them all, every connection it opens (Dask's own too) waits
    forever."""
    comm.abort()
    pool.reuse(addr, comm)


class PooledComm:
    """A comm taken from a worker's connection pool (``worker.rpc``), given
    back exactly once: for reuse after a stream ended at a message boundary,
    aborted otherwise (see :func:`drop`)."""

    def __init__(self, pool: ConnectionPool, addr: str, comm: Comm) -> None:
        self.pool = pool
        self.addr = addr
        self.comm = comm
        self.released = False

    def release(self, reusable: bool) -> None:
        if self.released:
            return
        self.released = True
        if reusable:
            self.pool.reuse(self.addr, self.comm)
        else:
            drop(self.pool, self.addr, self.comm)


async def open_pooled(pool: ConnectionPool, addr: str, timeout: float) -> PooledComm:
    """:func:`connect`, as a :class:`PooledComm` the caller must release."""
    return PooledComm(pool, addr, await connect(pool, addr, timeout))


@contextlib.asynccontextmanager
async def pooled_comm(pool: ConnectionPool, addr: str, timeout: float) -> AsyncIterator[Comm]:
    """A comm to ``addr`` for the body: reused when the body ends normally,
    aborted when it raises (or is cancelled) mid-stream."""
    pc = await open_pooled(pool, addr, timeout)
    try:
        yield pc.comm
    except BaseException:
        pc.release(False)
        raise
    pc.release(True)


async def wait_progress(buf: ObjectBuffer, threshold: int, timeout: float) -> None:
    """Wait until ``buf`` has more than ``threshold`` bytes, its layout is known
    (threshold 0, empty object), or it completed; raise if it failed or was
    interrupted first."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def wake(_: ObjectBuffer) -> None:
        if not fut.done():
            fut.set_result(None)

    buf.when(threshold, wake)
    try:
        await wait_for_future(fut, timeout)
    except asyncio.TimeoutError:
        raise StreamStalled(
            f"{buf.key!r} made no progress past byte {threshold} for {timeout:g}s"
        ) from None
    if buf.state is BufferState.FAILED:
        raise TransferFailed(f"upstream copy of {buf.key!r} failed: {buf.error}")
    if buf.interrupted is not None and buf.available(threshold) <= threshold:
        raise TransferFailed(f"upstream copy of {buf.key!r} stopped: {buf.interrupted}")


async def send_stream(
    comm: Comm,
    buf: ObjectBuffer,
    req: StreamRequest,
    *,
    window_bytes: int,
    stall_timeout: float,
    sent: list[int] | None = None,
) -> int:
    """Serve ``buf`` from ``req.offset`` (to ``req.end``) on ``comm`` as its
    progress grows.

    Returns the number of payload bytes sent; ``sent[0]``, if given, holds
    them as the stream goes (what a stream that broke had sent). Before each
    write, the buffer records the write's end for the reader
    (:meth:`ObjectBuffer.serving`): bytes beyond it were handed to no socket,
    so a reduce node may still change them (:meth:`ObjectBuffer.swap_bytes`).
    """
    sent = [0] if sent is None else sent
    assert buf.layout is not None
    layout = buf.layout
    total = req.stop(layout.nbytes)
    start = pos = req.start(layout.nbytes)
    stream = raw_stream(comm) if req.raw else None
    await comm.write({"status": "OK", "raw": stream is not None, **layout.to_msg()})
    peer = comm.peer_address
    reader = req.who or peer
    if stream is not None:
        while pos < total:
            if buf.available(pos) <= pos:
                await wait_progress(buf, pos, stall_timeout)
            end = min(buf.available(pos), layout.frame_end(pos), pos + RAW_WRITE_BYTES, total)
            buf.serving(reader, end)
            await _bounded(stream.write(buf.view(pos, end)), stall_timeout, "write", peer)
            pos = end
            sent[0] = pos - start
        return total - start

    window = SendWindow(start, window_bytes)
    while pos < total:
        while not window.can_send():
            window.on_ack(parse_ack(await _bounded(comm.read(), stall_timeout, "ack", peer)))
        if buf.available(pos) <= pos:
            await wait_progress(buf, pos, stall_timeout)
        end = min(buf.available(pos), layout.block_end(pos, req.block_bytes), total)
        buf.serving(reader, end)
        await comm.write({"offset": pos, "data": to_serialize(buf.view(pos, end))})
        window.on_sent(end)
        pos = end
        sent[0] = pos - start
    while window.acked < total:
        window.on_ack(parse_ack(await _bounded(comm.read(), stall_timeout, "ack", peer)))
    return total - start


async def open_stream(
    comm: Comm, req: StreamRequest, *, stall_timeout: float
) -> tuple[Layout, IOStream | None]:
    """Send ``req`` and read the sender's answer: the object's layout, and the
    tornado stream to read the payload from in raw mode (None: message mode)."""
    peer = comm.peer_address
    await comm.write(req.to_msg())
    reply = await _bounded(comm.read(), stall_timeout, "reply", peer)
    if isinstance(reply, dict) and reply.get("status") == "busy":
        raise SenderBusy(f"{peer} is at Dask's limit of transfers out")
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise ProtocolError(f"{peer} refused to stream {req.key!r}: {message}")
    layout = Layout.from_msg(reply)
    if req.offset > layout.nbytes:
        raise ProtocolError(f"resume offset {req.offset} is past the end ({layout.nbytes})")
    stream = raw_stream(comm) if reply.get("raw") else None
    if reply.get("raw") and stream is None:
        raise ProtocolError(f"{peer} answered in raw mode over a comm without a stream")
    return layout, stream


async def read_raw(stream: IOStream, into: memoryview, stall_timeout: float, peer: str) -> None:
    """Fill ``into`` from a raw-mode stream."""
    await _bounded(stream.read_into(into), stall_timeout, "block", peer)  # type: ignore[arg-type]


async def receive_stream(
    comm: Comm,
    buf: ObjectBuffer,
    req: StreamRequest,
    *,
    stall_timeout: float,
) -> int:
    """Fill ``buf`` from a stream requested with ``req`` on ``comm``.

    Returns the number of payload bytes received.
    """
    peer = comm.peer_address
    layout, stream = await open_stream(comm, req, stall_timeout=stall_timeout)
    buf.allocate(layout)
    total = req.stop(buf.nbytes)
    start = pos = req.start(buf.nbytes)
    if stream is not None:
        while pos < total:
            end = min(total, pos + req.block_bytes)
            await read_raw(stream, buf.writable_view(pos, end), stall_timeout, peer)
            pos = buf.advance(end)
        return total - start

    while pos < total:
        offset, data = parse_block(await _bounded(comm.read(), stall_timeout, "block", peer), pos)
        n = memoryview(data).nbytes
        if n == 0:
            raise ProtocolError(f"empty block at offset {offset} of {req.key!r}")
        buf.write(offset, data)
        pos = offset + n
        await comm.write({"ack": pos})
    return total - start
