"""Pipelined reduce trees on the workers.

Every node of the tree (planned by :mod:`dask_hoplite.core.planner`) holds one input.
It opens a block stream from each child's *partial result*, combines its own
operand with them block by block, in place, as the blocks land, and exposes its
own partial result as a buffer in the worker's block store, which its parent
streams from while it fills. So partial sums flow up the tree before any node
has finished, and the root's buffer is the result.

The root runs as a Dask task on the worker that holds the root's input (its
result is an ordinary Future); it starts the other nodes with the
``hoplite_reduce_node`` RPC, which runs on the event loop and needs no thread,
so several nodes on one worker cannot starve each other of task slots. A node
whose input does not match the root's (shape or dtype) fails with an error
naming it, which the root raises.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from distributed.comm.core import Comm
from distributed.protocol import serialize
from tornado.iostream import IOStream

from dask_hoplite.core.protocol import StreamRequest
from dask_hoplite.core.reduce_ops import ReduceOp, resolve_op
from dask_hoplite.core.reduce_spec import ReduceSpec, check_input
from dask_hoplite.core.store import Layout, ObjectBuffer
from dask_hoplite.errors import LayoutMismatch, ProtocolError, ReduceInputError
from dask_hoplite.streams import (
    connect,
    drop,
    open_stream,
    raw_stream,
    read_raw,
    receive_stream,
    wait_progress,
)

if TYPE_CHECKING:
    from dask_hoplite.worker import HopliteWorker

logger = logging.getLogger(__name__)


def result_layout(shape: tuple[int, ...], dtype: np.dtype) -> Layout:
    header, frames = serialize(np.empty(shape, dtype=dtype), serializers=("dask",))
    return Layout(header, tuple(memoryview(f).nbytes for f in frames))


def _operand(value: Any, spec: ReduceSpec, slot: int, rdt: np.dtype) -> np.ndarray:
    """The node's own input as a flat C-contiguous array of the result dtype."""
    like = (spec.inputs[spec.root], spec.shape, spec.dtype)
    value = check_input(value, spec.inputs[slot], like)
    flat = value.reshape(-1)  # a view when the input is contiguous
    if spec.segment is not None:
        lo, hi = spec.bounds()
        flat = flat[lo:hi]  # sliced before any dtype conversion: only this segment
    return np.ascontiguousarray(flat, dtype=rdt)


async def run_node(
    plugin: HopliteWorker, spec: ReduceSpec, slot: int, value: Any, offset: int = 0
) -> ObjectBuffer:
    """Combine this node's input with its children's streams into its partial
    buffer (announced in the store, so the parent can stream it as it fills).
    Returns the completed buffer. A node replacing a dead one starts at
    ``offset``, the byte its parent reached."""
    w = plugin.worker
    assert w is not None
    op: ReduceOp = resolve_op(spec.op)
    rdt = op.result_dtype(np.dtype(spec.dtype))
    key = spec.partial_key(slot)
    children = spec.children(slot)
    if not children:
        # A leaf's partial result is its own operand: serve it as it is.
        own = _operand(value, spec, slot, rdt)
        layout = result_layout(spec.node_shape(), rdt)
        leaf = plugin.store.add_source(key, layout.header, [own.view(np.uint8)])
        plugin.announced(key)
        return leaf
    acc = plugin.store.announce(key)
    plugin.announced(key)
    try:
        own = _operand(value, spec, slot, rdt)
        acc.allocate(result_layout(spec.node_shape(), rdt))
        itemsize = max(1, rdt.itemsize)
        block = max(itemsize, spec.block_bytes // itemsize * itemsize)
        job = _NodeJob(plugin, spec, children, op, rdt, own, acc, block, offset)
        if raw_capable(spec, children):
            await _combine_raw(job)
        elif offset:
            raise ProtocolError("only TCP/TLS reduce nodes resume from an offset")
        else:
            await _combine_buffered(job)
        return acc
    except BaseException as e:
        acc.fail(e if isinstance(e, Exception) else RuntimeError(str(e)))
        plugin.store.discard_if(key, acc)
        raise


@dataclass
class _NodeJob:
    """What one inner node combines: its input (in the result dtype), its
    children, and the buffer it fills in blocks of ``block`` bytes."""

    plugin: HopliteWorker
    spec: ReduceSpec
    children: list[int]
    op: ReduceOp
    rdt: np.dtype
    own: np.ndarray
    acc: ObjectBuffer
    block: int
    #: The first byte to produce (a replacement node: its parent has the rest).
    offset: int = 0

    def fields(self) -> tuple[Any, ...]:
        return (
            self.plugin,
            self.spec,
            self.children,
            self.op,
            self.rdt,
            self.own,
            self.acc,
            self.block,
        )


def _combine_block(
    op: ReduceOp,
    rdt: np.dtype,
    own: np.ndarray,
    acc: ObjectBuffer,
    a: int,
    b: int,
    parts: list[np.ndarray],
) -> None:
    """Bytes [a, b) of the node's result: own (+) every child's block, written
    in place (own (+) the first child straight into the output: one pass, no
    copy), then made visible to the parent."""
    itemsize = max(1, rdt.itemsize)
    out = np.frombuffer(acc.writable_view(a, b), dtype=rdt)
    op.ufunc(own[a // itemsize : b // itemsize], parts[0], out=out)
    for other in parts[1:]:
        op.combine(out, other)
    acc.advance(b)


def raw_capable(spec: ReduceSpec, children: list[int]) -> bool:
    """Whether every child can be read in raw mode (TCP/TLS comms)."""
    return all(spec.addresses[c].startswith(("tcp://", "tls://")) for c in children)


async def _combine_raw(job: _NodeJob) -> None:
    """Read each child's stream block by block into a small scratch buffer and
    combine straight from it (cache-hot, no child-sized allocation).

    A child whose stream breaks (its worker died) is replaced: the root of
    the tree starts a node for the child's input on a worker that holds it
    (recomputed if it was lost) and this node resumes the child's stream
    there from the block it reached. Its other children stream on."""
    plugin, spec, children, op, rdt, own, acc, block = job.fields()
    w = plugin.worker
    assert w is not None
    stall = plugin.config.stall_timeout
    total = acc.nbytes
    addresses = {c: spec.addresses[c] for c in children}
    opened: dict[int, tuple[str, Comm, IOStream]] = {}

    async def open_child(c: int, offset: int) -> None:
        addr = addresses[c]
        comm = await connect(w.rpc, addr, stall)
        try:
            req = StreamRequest(spec.partial_key(c), offset, block, None, raw=True)
            layout, stream = await open_stream(comm, req, stall_timeout=stall)
            if stream is None or layout.nbytes != total:
                raise LayoutMismatch(
                    f"child {spec.inputs[c]!r} answered with {layout.nbytes} bytes in "
                    f"{'raw' if stream else 'message'} mode; expected {total} in raw mode"
                )
        except BaseException:
            drop(w.rpc, addr, comm)
            raise
        opened[c] = (addr, comm, stream)

    async def replace_child(c: int, offset: int, error: Exception) -> None:
        if isinstance(error, (ReduceInputError, LayoutMismatch)):
            raise error
        if c in opened:
            addr, comm, _ = opened.pop(c)
            drop(w.rpc, addr, comm)
        addresses[c] = await plugin.replace_child(spec, c, offset, addresses[c], error)

    async def stream_of(c: int, offset: int) -> tuple[str, Comm, IOStream]:
        """Child ``c``'s open stream, from a replacement if it broke."""
        while c not in opened:
            try:
                await open_child(c, offset)
            except Exception as e:
                await replace_child(c, offset, e)
        return opened[c]

    async def read(c: int, into: memoryview, offset: int) -> None:
        while True:
            _, comm, stream = await stream_of(c, offset)
            try:
                await read_raw(stream, into, stall, comm.peer_address)
                return
            except Exception as e:
                await replace_child(c, offset, e)

    try:
        acc.start_at(job.offset)
        for c in children:
            await stream_of(c, job.offset)
        scratch = [memoryview(bytearray(block)) for _ in children]
        for a in range(job.offset, total, block):
            b = min(total, a + block)
            parts = []
            for c, sc in zip(children, scratch, strict=True):
                await read(c, sc[: b - a], a)
                parts.append(np.frombuffer(sc[: b - a], dtype=rdt))
            _combine_block(op, rdt, own, acc, a, b, parts)
    except BaseException:
        for addr, comm, _ in opened.values():
            drop(w.rpc, addr, comm)
        raise
    for addr, comm, _ in opened.values():
        w.rpc.reuse(addr, comm)


async def _combine_buffered(job: _NodeJob) -> None:
    """Message mode (comms other than TCP/TLS): stream each child into a full
    buffer and combine as its progress grows."""
    plugin, spec, children, op, rdt, own, acc, block = job.fields()
    stall = plugin.config.stall_timeout
    total = acc.nbytes
    child_bufs = [ObjectBuffer(spec.partial_key(c), plugin.store.pool) for c in children]
    tasks = [
        asyncio.create_task(_pull(plugin, spec, c, cbuf))
        for c, cbuf in zip(children, child_bufs, strict=True)
    ]
    try:
        for a in range(0, total, block):
            b = min(total, a + block)
            for cbuf in child_bufs:
                if cbuf.progress < b:
                    await wait_progress(cbuf, b - 1, stall)
                    _raise_if_failed(tasks)
            parts = [np.frombuffer(c.view(a, b), dtype=rdt) for c in child_bufs]
            _combine_block(op, rdt, own, acc, a, b, parts)
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


def _raise_if_failed(tasks: list[asyncio.Task[int]]) -> None:
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]


async def _pull(plugin: HopliteWorker, spec: ReduceSpec, child: int, buf: ObjectBuffer) -> int:
    """Stream a child's partial result into ``buf``."""
    w = plugin.worker
    assert w is not None
    addr = spec.addresses[child]
    comm: Comm = await connect(w.rpc, addr, plugin.config.stall_timeout)
    done = False
    try:
        req = StreamRequest(
            spec.partial_key(child), 0, spec.block_bytes, None, raw=raw_stream(comm) is not None
        )
        n = await receive_stream(comm, buf, req, stall_timeout=plugin.config.stall_timeout)
        w.rpc.reuse(addr, comm)
        done = True
        return n
    except BaseException as e:
        logger.debug("stream of partial %s from %s failed", buf.key, addr, exc_info=True)
        buf.fail(e if isinstance(e, Exception) else RuntimeError(str(e)))
        raise
    finally:
        if not done:
            drop(w.rpc, addr, comm)
