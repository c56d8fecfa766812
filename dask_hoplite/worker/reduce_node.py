"""A node of a pipelined reduce tree, on the worker that holds its input.

Every node of the tree (planned by :mod:`dask_hoplite.core.tree_shape`) holds one
input. It streams each child's *partial result*, combines its own operand
with them block by block (:mod:`dask_hoplite.worker.combine`), and exposes its
own partial result as a buffer in the worker's block store, which its parent
streams from while it fills. So partial sums flow up the tree before any node
has finished, and the root's buffer is the result.

The root (:mod:`dask_hoplite.worker.reduce_root`) starts the other nodes with
the ``hoplite_reduce_node`` RPC, which runs on the event loop and needs no
thread, so several nodes on one worker cannot starve each other of task
slots. A node whose input does not match the root's (shape or dtype) fails
with an error naming it, which the root raises. A node whose child's worker
died asks the root for a replacement (``hoplite_reduce_replace``) and reads on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from distributed.protocol import serialize
from distributed.utils import wait_for

from dask_hoplite.core.reduce_ops import ReduceOp, resolve_op
from dask_hoplite.core.reduce_spec import ReduceSpec, input_range, select_field
from dask_hoplite.core.store import BufferState, Layout, ObjectBuffer
from dask_hoplite.errors import ProtocolError, ReduceInputError, as_exception, node_reply
from dask_hoplite.worker.combine import (
    NodeJob,
    StreamInput,
    combine_buffered,
    combine_raw,
    raw_capable,
)
from dask_hoplite.worker.context import WorkerContext
from dask_hoplite.worker.reductions import RunningReductions

logger = logging.getLogger(__name__)


def result_layout(shape: tuple[int, ...], dtype: np.dtype) -> Layout:
    """The byte layout of a node's partial result (what Dask serialises an
    array of that shape and dtype into)."""
    header, frames = serialize(np.empty(shape, dtype=dtype), serializers=("dask",))
    return Layout(header, tuple(memoryview(f).nbytes for f in frames))


def _operand(
    value: Any,
    spec: ReduceSpec,
    slot: int,
    rdt: np.dtype,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """The node's own input as a flat C-contiguous array of the result dtype
    (a pytree's leaves packed, only this tree's segment of them, in memory
    from ``allocate``)."""
    lo, hi = spec.bounds()
    like = (spec.inputs[spec.root], spec.shape, spec.dtype)
    flat = input_range(value, spec.inputs[slot], like, spec.signature, lo, hi, allocate)
    # Sliced before any dtype conversion, so only the range is converted.
    return np.ascontiguousarray(flat, dtype=rdt)


@dataclass
class _RunningNode:
    """A node running here, as a spread finds it: the buffer it serves and,
    while it combines, its job."""

    spec: ReduceSpec
    rdt: np.dtype
    block: int
    buf: ObjectBuffer
    job: NodeJob | None = None


class ReduceNodes:
    """Runs this worker's nodes of reduce trees."""

    def __init__(self, ctx: WorkerContext, reductions: RunningReductions) -> None:
        self.ctx = ctx
        self.reductions = reductions
        #: The nodes running here, by (reduction id, slot).
        self.running: dict[tuple[str, int], _RunningNode] = {}

    async def run(
        self,
        spec: ReduceSpec,
        slot: int,
        value: Any,
        offset: int = 0,
        into: np.ndarray | None = None,
    ) -> ObjectBuffer:
        """Combine node ``slot``'s input with its children's streams into its
        partial buffer (announced in the store, so the parent can stream it as
        it fills). Returns the completed buffer. A node replacing a dead one
        starts at ``offset``, the byte its parent reached. ``into``: the
        bytes the buffer is made of, where they fit its layout (a segment's
        place in the whole result, for the root of a reduce in parts)."""
        store = self.ctx.store
        op: ReduceOp = resolve_op(spec.op)
        rdt = op.result_dtype(np.dtype(spec.dtype))
        itemsize = max(1, rdt.itemsize)
        block = max(itemsize, spec.block_bytes // itemsize * itemsize)
        key = spec.partial_key(slot)
        children = spec.children(slot)
        if not children:
            # A leaf's partial result is its own operand: serve it as it is.
            own = _operand(value, spec, slot, rdt, store.pool.allocate)
            layout = result_layout(spec.node_shape(), rdt)
            leaf = store.add_source(key, layout.header, [own.view(np.uint8)])
            self.running[spec.rid, slot] = _RunningNode(spec, rdt, block, leaf)
            self.reductions.announced(key)
            return leaf
        acc = store.announce(key)
        self.reductions.announced(key)
        try:
            own = _operand(value, spec, slot, rdt, store.pool.allocate)
            layout = result_layout(spec.node_shape(), rdt)
            fits = into is not None and layout.lengths == (into.size,)
            acc.allocate(layout, into if fits else None)
            repair = functools.partial(self.repair_child, spec)
            job = NodeJob(self.ctx, spec, children, op, rdt, own, acc, block, repair, offset)
            self.running[spec.rid, slot] = _RunningNode(spec, rdt, block, acc, job)
            if raw_capable(spec, children):
                await combine_raw(job)
            elif offset:
                raise ProtocolError("only TCP/TLS reduce nodes resume from an offset")
            else:
                await combine_buffered(job)
            if slot == spec.root:  # the result is complete: nothing needs the children
                self._release_children(spec.rid, job)
            return acc
        except BaseException as e:
            acc.fail(as_exception(e))
            store.discard_if(key, acc)
            raise
        finally:
            if slot == spec.root:  # the others are held until released
                self.running.pop((spec.rid, slot), None)

    async def handle_node(self, spec: dict[str, Any], slot: int, offset: int = 0) -> dict[str, Any]:
        """RPC ``hoplite_reduce_node``: run node ``slot`` of a reduce tree (from
        byte ``offset``: a node replacing a dead one)."""
        w = self.ctx.worker
        s = ReduceSpec.from_msg(spec)
        key = s.inputs[slot]
        refused = self.reductions.refusal(s.rid, starts=True)
        if refused is not None:
            return node_reply(refused)
        if key not in w.data:
            return node_reply(f"input {key!r} of the reduction is not in memory on {w.address}")
        try:
            value = select_field(w.data[key], s.field, key)
        except ReduceInputError as e:
            return node_reply(e)
        task = asyncio.create_task(self._run_until_released(s, slot, value, offset))
        try:
            with self.reductions.tracked(s.rid, task):
                await task
            return {"status": "OK"}
        except asyncio.CancelledError:  # aborted, or superseded by a later run
            return node_reply(self.reductions.superseded(s.rid) or "reduction aborted")
        except ReduceInputError as e:
            return node_reply(e)
        except Exception as e:
            logger.warning("reduce node %d of %s failed", slot, s.rid, exc_info=True)
            return node_reply(e)

    async def _run_until_released(
        self, spec: ReduceSpec, slot: int, value: Any, offset: int = 0
    ) -> None:
        """Run one non-root node and hold its partial result until its parent
        releases it, then release its own children.

        Having streamed all of its partial result is not enough: a parent
        that dies after reading all of it, before passing all of its own on,
        is replaced by a node that reads it again from where the grandparent
        stopped. So each partial result stays until its parent was released
        in turn, which starts at the root once it has the result. A dead
        parent releases nothing: the wait then ends when the root no longer
        runs the reduction (asked once per stall timeout of waiting)."""
        key = spec.partial_key(slot)
        root = spec.addresses[spec.root]
        alive = functools.partial(self._root_running, root, spec.rid)
        try:
            async with self.reductions.held_until_released(key, alive=alive):
                await self.run(spec, slot, value, offset)
            node = self.running.get((spec.rid, slot))
            if node is not None and node.job is not None:
                self._release_children(spec.rid, node.job)
        finally:
            self.running.pop((spec.rid, slot), None)

    def _release_children(self, rid: str, job: NodeJob) -> None:
        """Tell the workers of the children ``job`` read that their partial
        results are needed no more (in the background: a child that does not
        hear it lets go once the reduction has ended)."""
        by_address: dict[str, list[int]] = {}
        for inp in job.read:
            if inp.slot is not None:
                by_address.setdefault(inp.address, []).append(inp.slot)
        for address, slots in by_address.items():
            self.ctx.spawn(self._release(address, rid, slots))

    async def _release(self, address: str, rid: str, slots: list[int]) -> None:
        try:
            await wait_for(
                self.ctx.worker.rpc(address).hoplite_reduce_release(rid=rid, slots=slots),
                self.ctx.config.stall_timeout,
            )
        except Exception as e:
            logger.debug("could not release nodes %s of %s on %s: %s", slots, rid, address, e)

    async def _root_running(self, root: str, rid: str) -> bool:
        """Whether worker ``root`` still runs reduction ``rid`` (no answer
        within the stall timeout counts as no)."""
        try:
            return bool(
                await wait_for(
                    self.ctx.worker.rpc(root).hoplite_reduce_running(rid=rid),
                    self.ctx.config.stall_timeout,
                )
            )
        except Exception:
            return False

    async def repair_child(
        self, spec: ReduceSpec, slot: int, offset: int, dead: str, error: Exception
    ) -> str | list[StreamInput]:
        """Ask the root of ``spec`` to repair child node ``slot`` whose stream
        broke (``error``) at byte ``offset``: the address of its replacement,
        or the patches to read in its place (the dead node was spread).
        Raises ``error`` if the root refuses."""
        cfg = self.ctx.config
        root = spec.addresses[spec.root]
        logger.info(
            "child %d of reduction %s on %s broke at byte %d (%s: %s); asking the root",
            slot,
            spec.rid,
            dead,
            offset,
            type(error).__name__,
            error,
        )
        try:
            reply = await wait_for(
                self.ctx.worker.rpc(root).hoplite_reduce_replace(
                    rid=spec.rid, slot=slot, offset=offset, dead=dead
                ),
                cfg.queue_timeout + 2 * cfg.stall_timeout,
            )
        except Exception as e:
            raise error from e
        if reply.get("status") != "OK":
            raise error
        if "patches" in reply:
            self.ctx.event("reduce-children-spread", slot=slot, dead=dead)
            return [
                StreamInput(
                    spec.input_patch_key(p["slot"]) if p["input"] else spec.partial_key(p["slot"]),
                    p["address"],
                    p["start"],
                    p["end"],
                )
                for p in reply["patches"]
            ]
        self.ctx.event("reduce-children-replaced", slot=slot, dead=dead)
        return str(reply["address"])

    # ------------------------------------------------------------- spreads

    async def handle_adopt(
        self, rid: str, slot: int, child: int, address: str, at_least: int
    ) -> dict[str, Any]:
        """RPC ``hoplite_reduce_adopt``: node ``slot`` of reduction ``rid``
        combines child ``child`` (on ``address``) from a byte at or after
        ``at_least`` that it has not begun; replies that byte (None: the
        node no longer combines, its parent takes the whole rest)."""
        refused = self.reductions.refusal(rid)
        if refused is not None:
            return node_reply(refused)
        node = self.running.get((rid, slot))
        start = None
        if node is not None and node.job is not None:
            start = node.job.add_child(at_least, node.spec.partial_key(child), address, child)
        return {"status": "OK", "start": start}

    async def handle_merge(
        self, spec: dict[str, Any], slot: int, input_slot: int, at_least: int, dead: str
    ) -> dict[str, Any]:
        """RPC ``hoplite_reduce_merge``: node ``slot`` adds the input of dead
        node ``input_slot`` (recomputed on this worker; its old worker was
        ``dead``) into its stream, from a byte at or after ``at_least`` that
        no live reader has taken; replies that byte. The bytes before it are
        served for a patch, under :meth:`ReduceSpec.input_patch_key`."""
        s = ReduceSpec.from_msg(spec)
        refused = self.reductions.refusal(s.rid)
        if refused is not None:
            return node_reply(refused)
        key = s.inputs[input_slot]
        data = self.ctx.worker.data
        if key not in data:
            return node_reply(
                f"input {key!r} of the reduction is not in memory on {self.ctx.address}"
            )
        try:
            value = select_field(data[key], s.field, key)
            node = self.running.get((s.rid, slot))
            rdt = resolve_op(s.op).result_dtype(np.dtype(s.dtype))
            operand = _operand(value, s, input_slot, rdt, self.ctx.store.pool.allocate)
        except ReduceInputError as e:
            return node_reply(e)
        layout = result_layout(s.node_shape(), rdt)
        patch = self.ctx.store.add_source(
            s.input_patch_key(input_slot), layout.header, [operand.view(np.uint8)]
        )
        start: int | None = None
        if node is not None and node.job is not None and not node.job.finished:
            start = node.job.add_operand(at_least, operand)
        elif node is not None and node.buf.state is BufferState.COMPLETE:
            start = self._merge_served(node, operand, at_least, dead)
        if start == at_least:  # no patch: nobody will read it
            self.ctx.store.discard_if(s.input_patch_key(input_slot), patch)
        return {"status": "OK", "start": start}

    def _merge_served(
        self, node: _RunningNode, operand: np.ndarray, at_least: int, dead: str
    ) -> int:
        """Add ``operand`` into the complete buffer a node serves (a leaf's,
        or a finished node's), from the first block at or after ``at_least``
        that no reader but the ``dead`` worker has taken: the buffer's
        readers then read the sum."""
        buf, block = node.buf, node.block
        total = buf.nbytes
        start = min(total, -(-max(at_least, buf.served_to(ignore=dead)) // block) * block)
        if start < total:
            new = self.ctx.store.pool.allocate(total)
            pos = 0
            for frame in buf.frames():
                new[pos : pos + frame.nbytes] = np.frombuffer(frame, dtype=np.uint8)
                pos += frame.nbytes
            itemsize = max(1, node.rdt.itemsize)
            out = new[start:].view(node.rdt)
            resolve_op(node.spec.op).combine(out, operand[start // itemsize :])
            buf.swap_bytes(new)
        return start
