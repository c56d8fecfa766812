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
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.metrics import time as dask_time
from tornado.iostream import IOStream

from dask_hoplite.core.protocol import StreamRequest
from dask_hoplite.core.reduce_ops import ReduceOp
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.store import ObjectBuffer
from dask_hoplite.errors import LayoutMismatch, ReduceInputError, as_exception
from dask_hoplite.worker import accounting
from dask_hoplite.worker.context import WorkerContext
from dask_hoplite.worker.streams import (
    PooledComm,
    open_pooled,
    open_stream,
    pooled_comm,
    raw_stream,
    read_raw,
    receive_stream,
    wait_progress,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class StreamInput:
    """A stream one node combines, bytes ``[start, end)``: a child's partial
    result (``slot``; ``end`` the object's size), or a patch read in a dead
    child's place (``slot`` None; :mod:`dask_hoplite.core.tree_spread`)."""

    key: Key
    address: str
    start: int
    end: int
    slot: int | None = None


#: ``(slot, offset, dead address, error) -> repair`` of a child whose stream
#: broke: its replacement's address, or the patches to read in its place
#: (from ``offset``); raises ``error`` when the child cannot be repaired.
RepairChild = Callable[[int, int, str, Exception], Awaitable["str | list[StreamInput]"]]


@dataclass
class NodeJob:
    """What one inner node combines: its input (in the result dtype), its
    children, and the buffer it fills in blocks of ``block`` bytes. A spread
    (:meth:`add_operand`, :meth:`add_child`) adds an operand or a child from a
    block the node has not begun."""

    ctx: WorkerContext
    spec: ReduceSpec
    children: list[int]
    op: ReduceOp
    rdt: np.dtype
    own: np.ndarray
    acc: ObjectBuffer
    block: int
    repair_child: RepairChild
    #: The first byte to produce (a replacement node: its parent has the rest).
    offset: int = 0
    #: Operands added mid-stream: (first byte, flat array of the result dtype).
    extras: list[tuple[int, np.ndarray]] = field(default_factory=list)
    #: Children added mid-stream, for the combining loop to open.
    added: list[StreamInput] = field(default_factory=list)
    #: The end of the last block whose inputs are fixed; a new operand or
    #: child starts here or later.
    begun: int = 0
    #: Whether the combining loop has finished (nothing can be added).
    finished: bool = False
    #: Once finished: the children whose partial results this node read to
    #: the end, where it read them (a replacement's address, an adopted
    #: child's), which it releases when it is released itself.
    read: list[StreamInput] = field(default_factory=list)

    def planned_children(self) -> list[StreamInput]:
        """The streams of the children the tree's spec gives this node."""
        total = self.acc.nbytes
        return [
            StreamInput(self.spec.partial_key(c), self.spec.addresses[c], self.offset, total, c)
            for c in self.children
        ]

    def first_open_byte(self, at_least: int) -> int | None:
        """The byte from which a new operand or child can join this node's
        stream, at or after ``at_least`` (None: the node has finished)."""
        if self.finished:
            return None
        return max(at_least, self.begun, self.offset)

    def add_operand(self, at_least: int, operand: np.ndarray) -> int | None:
        """Add ``operand`` into this node's stream from a block not begun yet,
        at or after byte ``at_least``; that byte (None: too late)."""
        start = self.first_open_byte(at_least)
        if start is not None:
            self.extras.append((start, operand))
        return start

    def add_child(self, at_least: int, key: Key, address: str, slot: int) -> int | None:
        """Combine child ``slot``'s stream (``key`` on ``address``) from a
        block not begun yet, at or after byte ``at_least``; that byte."""
        start = self.first_open_byte(at_least)
        if start is not None and start < self.acc.nbytes:
            self.added.append(StreamInput(key, address, start, self.acc.nbytes, slot))
        return start

    def combine_block(self, a: int, b: int, parts: list[np.ndarray]) -> None:
        """Bytes [a, b) of the node's result: own (+) every child's block
        (+) the operands added by now, written in place (own (+) the first
        child straight into the output: one pass, no copy), then made visible
        to the parent."""
        itemsize = max(1, self.rdt.itemsize)
        i, j = a // itemsize, b // itemsize
        out = np.frombuffer(self.acc.writable_view(a, b), dtype=self.rdt)
        if parts:
            self.op.ufunc(self.own[i:j], parts[0], out=out)
        else:
            out[...] = self.own[i:j]
        for other in parts[1:]:
            self.op.combine(out, other)
        for start, operand in self.extras:
            if start <= a:
                self.op.combine(out, operand[i:j])
        self.acc.advance(b)


def raw_capable(spec: ReduceSpec, children: list[int]) -> bool:
    """Whether every child can be read in raw mode (TCP/TLS comms)."""
    return all(spec.addresses[c].startswith(("tcp://", "tls://")) for c in children)


class _RawInputs:
    """The raw-mode streams a node combines: its children, each repaired when
    it breaks (replaced, or read in patches in its place), and what a spread
    adds."""

    def __init__(self, job: NodeJob) -> None:
        self.job = job
        self.inputs = job.planned_children()
        self.opened: dict[StreamInput, tuple[PooledComm, IOStream]] = {}
        self.scratch: dict[StreamInput, memoryview] = {}

    async def _open(self, inp: StreamInput, offset: int) -> None:
        job = self.job
        stall = job.ctx.config.stall_timeout
        pc = await open_pooled(job.ctx.worker.rpc, inp.address, stall)
        try:
            end = None if inp.end >= job.acc.nbytes else inp.end
            req = StreamRequest(
                inp.key, offset, job.block, None, raw=True, who=job.ctx.address, end=end
            )
            layout, stream = await open_stream(pc.comm, req, stall_timeout=stall)
            if stream is None or layout.nbytes != job.acc.nbytes:
                raise LayoutMismatch(
                    f"{inp.key!r} on {inp.address} answered with {layout.nbytes} bytes in "
                    f"{'raw' if stream else 'message'} mode; expected {job.acc.nbytes} in raw mode"
                )
        except BaseException:
            pc.release(False)
            raise
        self.opened[inp] = (pc, stream)

    async def _repair(self, inp: StreamInput, offset: int, error: Exception) -> list[StreamInput]:
        """``inp`` broke at ``offset``: the inputs to read in its place from
        there (itself from a replacement, or patches)."""
        if isinstance(error, (ReduceInputError, LayoutMismatch)) or inp.slot is None:
            raise error  # a patch is not repaired: the tree restarts
        if inp in self.opened:
            pc, _ = self.opened.pop(inp)
            pc.release(False)
        repair = await self.job.repair_child(inp.slot, offset, inp.address, error)
        if isinstance(repair, str):
            inp.address = repair
            return [inp]
        inp.end = offset  # read no more: the patches (and adopters) carry it on
        self.inputs.extend(repair)
        return [p for p in repair if p.start <= offset < p.end]

    async def open_all(self, offset: int) -> None:
        """Open every input's stream from ``offset`` before the first block:
        each sender starts at once, and a child with nothing to send (an empty
        object) learns at once that its parent has all of it."""
        todo = collections.deque(self.inputs)
        while todo:
            inp = todo.popleft()
            try:
                await self._stream_of(inp, offset)
            except Exception as e:
                todo.extend(await self._repair(inp, offset, e))

    async def _stream_of(self, inp: StreamInput, offset: int) -> tuple[PooledComm, IOStream]:
        if inp not in self.opened:
            await self._open(inp, offset)
        return self.opened[inp]

    async def read_block(self, a: int, b: int) -> list[np.ndarray]:
        """Block [a, b) of every input that covers it, repairing the inputs
        that break meanwhile."""
        job = self.job
        stall = job.ctx.config.stall_timeout
        self.inputs += job.added
        job.added.clear()
        todo = collections.deque(i for i in self.inputs if i.start <= a < i.end)
        parts = []
        while todo:
            inp = todo.popleft()
            scratch = self.scratch.get(inp)
            if scratch is None:  # once per input, not per block
                scratch = self.scratch[inp] = memoryview(bytearray(job.block))
            into = scratch[: b - a]
            try:
                pc, stream = await self._stream_of(inp, a)
                with context_meter.meter("network", func=dask_time):
                    await read_raw(stream, into, stall, pc.comm.peer_address)
            except Exception as e:
                todo.extend(await self._repair(inp, a, e))
                continue
            parts.append(np.frombuffer(into, dtype=job.rdt))
            if b >= inp.end and b < job.acc.nbytes:  # a patch read to its end
                pc, _ = self.opened.pop(inp)
                pc.release(True)
                self.scratch.pop(inp, None)
        return parts

    def release_all(self, reusable: bool) -> None:
        for pc, _ in self.opened.values():
            pc.release(reusable)
        self.opened.clear()

    def record(self, start: float) -> None:
        """Each input's stream, whole, in Dask's transfer records."""
        job = self.job
        for inp in self.inputs:
            nbytes = max(0, min(inp.end, job.acc.nbytes) - inp.start)
            if job.ctx.accounting:
                accounting.received(
                    job.ctx.worker, inp.key, inp.address, start, dask_time(), nbytes
                )
            job.ctx.count("bytes-received", nbytes)


async def combine_raw(job: NodeJob) -> None:
    """Combine in raw mode; a child whose stream breaks (its worker died) is
    repaired and this node reads on from the block reached, while its other
    children stream on."""
    inputs = _RawInputs(job)
    total = job.acc.nbytes
    start = dask_time()
    streams = contextlib.ExitStack()
    for c in job.children:
        key = job.spec.partial_key(c)
        streams.enter_context(job.ctx.receiving(key, job.spec.addresses[c], job.acc, "reduce"))
    try:
        job.acc.start_at(job.offset)
        job.begun = job.offset
        await inputs.open_all(job.offset)
        for a in range(job.offset, total, job.block):
            b = min(total, a + job.block)
            job.begun = b
            parts = await inputs.read_block(a, b)
            job.combine_block(a, b, parts)
    except BaseException:
        inputs.release_all(False)
        raise
    finally:
        job.finished = True
        streams.close()
    inputs.release_all(True)
    inputs.record(start)
    job.read = [i for i in inputs.inputs if i.slot is not None and i.end >= total]


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
        job.read = job.planned_children()
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
        if job.ctx.accounting:
            accounting.received(job.ctx.worker, key, addr, start, dask_time(), n)
        job.ctx.count("bytes-received", n)
        return n
    except BaseException as e:
        logger.debug("stream of partial %s from %s failed", buf.key, addr, exc_info=True)
        buf.fail(as_exception(e))
        raise
