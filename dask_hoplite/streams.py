"""Moving blocks over ``distributed.comm``: the sender and receiver loops of
the block-stream protocol (:mod:`dask_hoplite.protocol`).

Comms come from the worker's own connection pool, so TLS, ``require_encryption``
and other comm backends apply unchanged. Blocks travel as out-of-band frames
(``to_serialize(memoryview)``): no pickling, no copy on the sending side.
Every wait is bounded by ``stall_timeout``: a peer that makes no progress for
that long is treated as failed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from distributed.comm.core import Comm
from distributed.protocol import to_serialize

from dask_hoplite.protocol import (
    ProtocolError,
    SendWindow,
    StreamRequest,
    parse_ack,
    parse_block,
)
from dask_hoplite.store import BufferState, Layout, ObjectBuffer

logger = logging.getLogger(__name__)


class StreamStalled(TimeoutError):
    """A peer made no progress for ``hoplite.stall-timeout``."""


async def _read(comm: Comm, timeout: float, what: str) -> Any:
    try:
        return await asyncio.wait_for(comm.read(), timeout)
    except asyncio.TimeoutError:
        raise StreamStalled(f"no {what} from {comm.peer_address} for {timeout:g}s") from None


async def wait_progress(buf: ObjectBuffer, threshold: int, timeout: float) -> None:
    """Wait until ``buf`` has more than ``threshold`` bytes, its layout is known
    (threshold 0, empty object), or it completed or failed."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def wake(_: ObjectBuffer) -> None:
        if not fut.done():
            fut.set_result(None)

    buf.when(threshold, wake)
    try:
        await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        raise StreamStalled(
            f"{buf.key!r} made no progress past byte {threshold} for {timeout:g}s"
        ) from None
    if buf.state is BufferState.FAILED:
        raise RuntimeError(f"upstream copy of {buf.key!r} failed: {buf.error}")


async def send_stream(
    comm: Comm,
    buf: ObjectBuffer,
    req: StreamRequest,
    *,
    window_bytes: int,
    stall_timeout: float,
) -> int:
    """Serve ``buf`` from ``req.offset`` on ``comm`` as its progress grows.

    Returns the number of payload bytes sent.
    """
    assert buf.layout is not None
    layout = buf.layout
    total = layout.nbytes
    await comm.write({"status": "OK", **layout.to_msg()})
    window = SendWindow(req.offset, window_bytes)
    pos = req.offset
    while pos < total:
        while not window.can_send():
            window.on_ack(parse_ack(await _read(comm, stall_timeout, "ack")))
        if buf.progress <= pos:
            await wait_progress(buf, pos, stall_timeout)
        end = min(buf.progress, layout.block_end(pos, req.block_bytes))
        await comm.write({"offset": pos, "data": to_serialize(buf.view(pos, end))})
        window.on_sent(end)
        pos = end
    while window.acked < total:
        window.on_ack(parse_ack(await _read(comm, stall_timeout, "ack")))
    return total - req.offset


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
    await comm.write(req.to_msg())
    reply = await _read(comm, stall_timeout, "reply")
    if not isinstance(reply, dict) or reply.get("status") != "OK":
        message = reply.get("message") if isinstance(reply, dict) else reply
        raise ProtocolError(f"{comm.peer_address} refused to stream {req.key!r}: {message}")
    buf.allocate(Layout.from_msg(reply))
    total = buf.nbytes
    if req.offset > total:
        raise ProtocolError(f"resume offset {req.offset} is past the end ({total})")
    pos = req.offset
    while pos < total:
        offset, data = parse_block(await _read(comm, stall_timeout, "block"), pos)
        n = memoryview(data).nbytes
        if n == 0:
            raise ProtocolError(f"empty block at offset {offset} of {req.key!r}")
        buf.write(offset, data)
        pos = offset + n
        await comm.write({"ack": pos})
    return total - req.offset
