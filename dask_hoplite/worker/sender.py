"""Serving streams: the ``hoplite_stream`` peer handler.

A peer asks for a key from a byte offset (:mod:`dask_hoplite.core.protocol`).
The sender serves it from this worker's buffer of the key (complete, or still
filling: a relay forwards bytes as they land), from the object in
``worker.data`` serialised once (zero-copy for numpy arrays), or from a buffer
that is yet to come (a reduce node's partial result, before its node started).

The sender is transport: it knows nothing of reductions. What it may wait for
and what a finished stream means to the rest of the worker, it asks of the
:class:`StreamHooks` it is given (the worker's running reductions).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from dask.typing import Key
from distributed.comm import get_address_host
from distributed.comm.core import Comm, CommClosedError
from distributed.core import Status

from dask_hoplite.core.protocol import BUSY_REPLY, StreamRequest, error_reply
from dask_hoplite.core.store import BufferState, ObjectBuffer
from dask_hoplite.errors import ProtocolError
from dask_hoplite.worker import accounting
from dask_hoplite.worker.context import WorkerContext
from dask_hoplite.worker.streams import forget_frames, send_stream, wait_progress

logger = logging.getLogger(__name__)


class StreamHooks(Protocol):
    """What the sender asks of the rest of the worker."""

    async def coming(self, key: Key) -> ObjectBuffer | None:
        """The buffer of ``key``, which this worker does not hold yet, once it
        is there (None: it will not be)."""

    def streamed(self, key: Key, buf: ObjectBuffer, whole: bool) -> None:
        """A stream of ``buf``, the buffer of ``key``, ended well; ``whole``:
        it carried the whole of it, to its end."""


class Sender:
    """Streams keys out of this worker to peers that ask."""

    def __init__(self, ctx: WorkerContext, hooks: StreamHooks) -> None:
        self.ctx = ctx
        self.hooks = hooks

    async def source(self, key: Key) -> ObjectBuffer | None:
        """The buffer to serve ``key`` from (None: this worker has no copy)."""
        store = self.ctx.store
        buf = store.get(key)
        if buf is not None and buf.state is not BufferState.FAILED:
            return buf
        coming = await self.hooks.coming(key)
        if coming is not None:
            return coming
        held = await self.ctx.serialize_held(key)
        if held is None:
            return None
        header, frames = held
        return store.add_source(key, header, frames)

    async def _open(self, req: StreamRequest) -> ObjectBuffer:
        """The buffer for ``req``, its layout known; raises what to refuse with."""
        buf = await self.source(req.key)
        if buf is None:
            raise ProtocolError(f"worker {self.ctx.address} holds no copy of key {req.key!r}")
        if buf.layout is None:  # announced, the receiver's own sender not connected yet
            await wait_progress(buf, 0, self.ctx.config.stall_timeout)
        assert buf.layout is not None
        if req.offset > buf.layout.nbytes:
            raise ProtocolError(
                f"offset {req.offset} is past the end of {req.key!r} ({buf.layout.nbytes} bytes)"
            )
        return buf

    def busy(self, req: StreamRequest, peer: str) -> bool:
        """Whether Dask's limit on this worker's concurrent transfers out is
        reached, as ``Worker.get_data`` decides it for Dask's own: its
        ``transfer_outgoing_count_limit`` (doubled for a peer on this host,
        1 while paused), counting hoplite's streams out with Dask's. Only the
        transfers the directory assigned are limited (their receiver can take
        another holder); the streams of a reduce tree or an allreduce are
        planned, and a node must read its children."""
        if req.transfer_id is None:
            return False
        w = self.ctx.worker
        limit = getattr(w, "transfer_outgoing_count_limit", False)
        if limit is False or limit is None:
            return False
        if get_address_host(peer) == get_address_host(w.address):
            limit *= 2
        if w.status == Status.paused:
            limit = 1
        # With the accounting on, hoplite's streams are in Dask's count.
        count = w.transfer_outgoing_count if self.ctx.accounting else self.ctx.outgoing
        return bool(count >= limit)

    @accounting.metered_as("get-data")
    async def handle_stream(self, comm: Comm, **msg: Any) -> Status:
        """Peer handler ``hoplite_stream``: stream a key from a byte offset,
        counted in the worker's outgoing transfers as Dask counts its own."""
        ctx = self.ctx
        try:
            req = StreamRequest.parse(msg)
            # Busy first, as Dask's get_data: a refused request costs no
            # serialisation of the held object.
            busy = self.busy(req, comm.peer_address)
            buf = None if busy else await self._open(req)
        except Exception as e:
            logger.info("refusing hoplite stream to %s: %s", comm.peer_address, e)
            ctx.event("requests-refused", peer=comm.peer_address, reason=str(e))
            try:
                await comm.write(error_reply(str(e)))
            except (CommClosedError, OSError):
                pass
            return Status.dont_reply
        who = req.who or comm.peer_address
        if buf is None:
            logger.debug("busy: no hoplite stream of %r to %s now", req.key, who)
            ctx.count("requests-busy")
            try:
                await comm.write(BUSY_REPLY)
            except (CommClosedError, OSError):
                pass
            return Status.dont_reply
        try:
            with (
                ctx.streaming_out(),
                accounting.sending(
                    ctx.worker,
                    req.key,
                    who,
                    req.stop(buf.nbytes) - req.start(buf.nbytes),
                    counted=ctx.accounting,
                ) as sent,
            ):
                n = await send_stream(
                    comm,
                    buf,
                    req,
                    window_bytes=ctx.config.window_bytes,
                    stall_timeout=ctx.config.stall_timeout,
                    sent=sent,
                )
            ctx.count("bytes-sent", n)
            self.hooks.streamed(req.key, buf, req.part is None and req.offset + n == buf.nbytes)
        except Exception as e:
            logger.info("hoplite stream of %r to %s ended: %s", req.key, comm.peer_address, e)
            ctx.count("streams-aborted")
            comm.abort()
            forget_frames(e)
        return Status.dont_reply
