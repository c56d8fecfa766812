"""How one inner node of a reduce tree combines its children's streams with its
own operand, block by block, in place, as the blocks land.

Two transports:

* raw mode (TCP/TLS comms): each child's stream is read block by block into a
  small scratch buffer and combined straight from it (cache-hot, no
  child-sized allocation). A child whose stream breaks is replaced (the root
  starts a node for its input elsewhere) and read on from the block reached;
* message mode (other comm backends): each child streams into a full buffer
  and the node combines as its progress grows.

The node's result buffer advances after each block, so its parent streams it
while it fills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
from distributed.metrics import context_meter
from distributed.metrics import time as dask_time
from tornado.iostream import IOStream

from dask_hoplite.core.protocol import StreamRequest
from dask_hoplite.core.reduce_ops import ReduceOp
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.store import ObjectBuffer
from dask_hoplite.errors import LayoutMismatch, ReduceInputError
from dask_hoplite.streams import (
    PooledComm,
    open_pooled,
    open_stream,
    pooled_comm,
    raw_stream,
    read_raw,
    receive_stream,
    wait_progress,
)
from dask_hoplite.worker import accounting
from dask_hoplite.worker.context import WorkerContext

logger = logging.getLogger(__name__)

#: ``(slot, offset, dead address, error) -> new address`` of a replaced child;
#: raises ``error`` when the child cannot be replaced.
ReplaceChild = Callable[[int, int, str, Exception], Awaitable[str]]


@dataclass
class NodeJob:
    """What one inner node combines: its input (in the result dtype), its
    children, and the buffer it fills in blocks of ``block`` bytes."""

    ctx: WorkerContext
    spec: ReduceSpec
    children: list[int]
    op: ReduceOp
    rdt: np.dtype
    own: np.ndarray
    acc: ObjectBuffer
    block: int
    replace_child: ReplaceChild
    #: The first byte to produce (a replacement node: its parent has the rest).
    offset: int = 0

    def combine_block(self, a: int, b: int, parts: list[np.ndarray]) -> None:
        """Bytes [a, b) of the node's result: own (+) every child's block,
        written in place (own (+) the first child straight into the output:
        one pass, no copy), then made visible to the parent."""
        itemsize = max(1, self.rdt.itemsize)
        out = np.frombuffer(self.acc.writable_view(a, b), dtype=self.rdt)
        self.op.ufunc(self.own[a // itemsize : b // itemsize], parts[0], out=out)
        for other in parts[1:]:
            self.op.combine(out, other)
        self.acc.advance(b)


def raw_capable(spec: ReduceSpec, children: list[int]) -> bool:
    """Whether every child can be read in raw mode (TCP/TLS comms)."""
    return all(spec.addresses[c].startswith(("tcp://", "tls://")) for c in children)


class _RawChildren:
    """The raw-mode streams of a node's children, each replaced when it breaks."""

    def __init__(self, job: NodeJob) -> None:
        self.job = job
        self.addresses = {c: job.spec.addresses[c] for c in job.children}
        self.opened: dict[int, tuple[PooledComm, IOStream]] = {}

    async def _open(self, c: int, offset: int) -> None:
        job = self.job
        stall = job.ctx.config.stall_timeout
        pc = await open_pooled(job.ctx.worker.rpc, self.addresses[c], stall)
        try:
            req = StreamRequest(
                job.spec.partial_key(c), offset, job.block, None, raw=True, who=job.ctx.address
            )
            layout, stream = await open_stream(pc.comm, req, stall_timeout=stall)
            if stream is None or layout.nbytes != job.acc.nbytes:
                raise LayoutMismatch(
                    f"child {job.spec.inputs[c]!r} answered with {layout.nbytes} bytes in "
                    f"{'raw' if stream else 'message'} mode; expected {job.acc.nbytes} in raw mode"
                )
        except BaseException:
            pc.release(False)
            raise
        self.opened[c] = (pc, stream)

    async def _replace(self, c: int, offset: int, error: Exception) -> None:
        if isinstance(error, (ReduceInputError, LayoutMismatch)):
            raise error
        if c in self.opened:
            pc, _ = self.opened.pop(c)
            pc.release(False)
        self.addresses[c] = await self.job.replace_child(c, offset, self.addresses[c], error)

    async def stream_of(self, c: int, offset: int) -> tuple[PooledComm, IOStream]:
        """Child ``c``'s open stream, from a replacement if it broke."""
        while c not in self.opened:
            try:
                await self._open(c, offset)
            except Exception as e:
                await self._replace(c, offset, e)
        return self.opened[c]

    async def read(self, c: int, into: memoryview, offset: int) -> None:
        stall = self.job.ctx.config.stall_timeout
        while True:
            pc, stream = await self.stream_of(c, offset)
            try:
                with context_meter.meter("network", func=dask_time):
                    await read_raw(stream, into, stall, pc.comm.peer_address)
                return
            except Exception as e:
                await self._replace(c, offset, e)

    def release_all(self, reusable: bool) -> None:
        for pc, _ in self.opened.values():
            pc.release(reusable)

    def record(self, start: float, nbytes: int) -> None:
        """Each child's stream, whole, in Dask's transfer records."""
        job = self.job
        for c in job.children:
            key = job.spec.partial_key(c)
            accounting.received(job.ctx.worker, key, self.addresses[c], start, dask_time(), nbytes)
            job.ctx.count("bytes-received", nbytes)


async def combine_raw(job: NodeJob) -> None:
    """Combine in raw mode; a child whose stream breaks (its worker died) is
    replaced and this node resumes its stream there from the block reached,
    while its other children stream on."""
    children = _RawChildren(job)
    total = job.acc.nbytes
    start = dask_time()
    streams = contextlib.ExitStack()
    for c in job.children:
        key = job.spec.partial_key(c)
        streams.enter_context(job.ctx.receiving(key, job.spec.addresses[c], job.acc, "reduce"))
    try:
        job.acc.start_at(job.offset)
        for c in job.children:
            await children.stream_of(c, job.offset)
        scratch = [memoryview(bytearray(job.block)) for _ in job.children]
        for a in range(job.offset, total, job.block):
            b = min(total, a + job.block)
            parts = []
            for c, sc in zip(job.children, scratch, strict=True):
                await children.read(c, sc[: b - a], a)
                parts.append(np.frombuffer(sc[: b - a], dtype=job.rdt))
            job.combine_block(a, b, parts)
    except BaseException:
        children.release_all(False)
        raise
    finally:
        streams.close()
    children.release_all(True)
    children.record(start, total - job.offset)


async def combine_buffered(job: NodeJob) -> None:
    """Message mode (comms other than TCP/TLS): stream each child into a full
    buffer and combine as its progress grows."""
    stall = job.ctx.config.stall_timeout
    total = job.acc.nbytes
    child_bufs = [ObjectBuffer(job.spec.partial_key(c), job.ctx.store.pool) for c in job.children]
    tasks = [
        asyncio.create_task(_pull(job, c, cbuf))
        for c, cbuf in zip(job.children, child_bufs, strict=True)
    ]
    try:
        for a in range(0, total, job.block):
            b = min(total, a + job.block)
            for cbuf in child_bufs:
                if cbuf.progress < b:
                    await wait_progress(cbuf, b - 1, stall)
                    _raise_if_failed(tasks)
            parts = [np.frombuffer(c.view(a, b), dtype=job.rdt) for c in child_bufs]
            job.combine_block(a, b, parts)
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _raise_if_failed(tasks: list[asyncio.Task[int]]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


async def _pull(job: NodeJob, child: int, buf: ObjectBuffer) -> int:
    """Stream a child's partial result into ``buf``."""
    spec, stall = job.spec, job.ctx.config.stall_timeout
    addr = spec.addresses[child]
    start = dask_time()
    try:
        with (
            job.ctx.receiving(spec.partial_key(child), addr, buf, "reduce"),
            context_meter.meter("network", func=dask_time),
        ):
            async with pooled_comm(job.ctx.worker.rpc, addr, stall) as comm:
                raw = raw_stream(comm) is not None
                key = spec.partial_key(child)
                req = StreamRequest(key, 0, spec.block_bytes, None, raw=raw, who=job.ctx.address)
                n = await receive_stream(comm, buf, req, stall_timeout=stall)
        accounting.received(job.ctx.worker, key, addr, start, dask_time(), n)
        job.ctx.count("bytes-received", n)
        return n
    except BaseException as e:
        logger.debug("stream of partial %s from %s failed", buf.key, addr, exc_info=True)
        buf.fail(e if isinstance(e, Exception) else RuntimeError(str(e)))
        raise
