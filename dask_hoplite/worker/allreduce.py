"""Allreduce of large objects on the workers: chains of copies and segments.

Two shapes, both planned by :mod:`dask_hoplite.core.reduce_plan`
(:class:`~dask_hoplite.core.reduce_plan.AllreduceTree`,
:class:`~dask_hoplite.core.reduce_plan.SegmentedAllreduce`):

* one reduce tree whose result streams, while it is being reduced, through a
  chain of *copies* (each copy streams the one before it; the first streams
  the root's partial result);
* a *segmented* allreduce: m concurrent reduce-then-copy pipelines, one per
  segment of 1/m of the object, each rooted on another worker; every worker
  runs the root of its segment, a copy of every other segment, then assembles
  the whole result.

A pipeline that breaks (a worker died or stalled) falls back to a plain,
restartable reduction of all the inputs rooted on this worker
(:meth:`Allreduce.reduce_anew`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Awaitable
from typing import Any

import numpy as np
from dask.typing import Key
from distributed.metrics import context_meter
from distributed.metrics import time as dask_time

from dask_hoplite.core.protocol import StreamRequest
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_plan import PlanRequest, Tree, plan_from_msg
from dask_hoplite.core.reduce_spec import ReduceSpec, as_input, flat_shape, join_segments
from dask_hoplite.core.store import ObjectBuffer
from dask_hoplite.errors import CollectiveAborted, ReduceInputError, StaleRun, as_exception
from dask_hoplite.scheduler_calls import request_plan
from dask_hoplite.worker import accounting
from dask_hoplite.worker.context import FetchParts, WorkerContext, all_or_cancel, cancel_quietly
from dask_hoplite.worker.reduce_root import ReduceRoots
from dask_hoplite.worker.reductions import RunningReductions
from dask_hoplite.worker.streams import pooled_comm, raw_stream, receive_stream

logger = logging.getLogger(__name__)


class Allreduce:
    """This worker's roots, segments and copies of large allreduces."""

    def __init__(
        self,
        ctx: WorkerContext,
        reductions: RunningReductions,
        roots: ReduceRoots,
        fetch_parts: FetchParts,
    ) -> None:
        self.ctx = ctx
        self.reductions = reductions
        self.roots = roots
        self.fetch_parts = fetch_parts

    async def _or_reduce_anew(
        self, what: str, attempt: Awaitable[Any], spec: ReduceSpec, slot: int, value: Any
    ) -> Any:
        """``attempt``'s result, or, if its pipeline broke, the whole
        reduction of ``spec``'s inputs here (an input that does not fit, and
        a run that a later one superseded, are final)."""
        try:
            return await attempt
        except (ReduceInputError, StaleRun):
            raise
        except Exception as e:
            logger.warning(
                "%s of %s broke (%s: %s); reducing all inputs here",
                what,
                spec.rid,
                type(e).__name__,
                e,
            )
            return await self.reduce_anew(spec, slot, value)

    async def run_root(self, value: Any, spec_msg: dict[str, Any]) -> Any:
        """The root of an allreduce with copies, as a Dask task."""
        spec = ReduceSpec.from_msg(spec_msg)
        if spec.addresses[spec.root] != self.ctx.address:
            return await self.reduce_anew(spec, spec.root, value)  # its worker died
        run = self.roots.run(value, spec_msg)
        return await self._or_reduce_anew("allreduce root", run, spec, spec.root, value)

    async def run_copy(self, spec_msg: dict[str, Any], j: int) -> Any:
        """Allreduce copy ``j`` as a Dask task: :meth:`pull_copy`, or, if the
        pipeline broke, the whole reduction here."""
        spec = ReduceSpec.from_msg(spec_msg)
        pull = self.pull_copy(spec_msg, j)
        return await self._or_reduce_anew(f"allreduce copy {j}", pull, spec, spec.root, None)

    async def run_part(self, value: Any, spec_msgs: list[dict[str, Any]], mine: int) -> Any:
        """One worker's part of a segmented allreduce: the root of segment
        ``mine`` (its reduce tree and the chain of copies streaming its result
        run concurrently with everyone else's), a copy of every other segment,
        then the whole result assembled from the segments."""
        specs = [ReduceSpec.from_msg(m) for m in spec_msgs]
        mine_spec = specs[mine]
        if mine_spec.addresses[mine_spec.root] != self.ctx.address:
            # Dask ran this part on another worker (its own died): the
            # segments' pipelines are broken; reduce everything here.
            return await self.reduce_anew(mine_spec, mine_spec.root, value)
        run = self._segments(value, spec_msgs, specs, mine)
        result = await self._or_reduce_anew(
            "segmented allreduce", run, mine_spec, mine_spec.root, value
        )
        return as_input(value, mine_spec.inputs[mine_spec.root], result)

    async def _segments(
        self, value: Any, spec_msgs: list[dict[str, Any]], specs: list[ReduceSpec], mine: int
    ) -> Any:
        me = self.ctx.address
        # The first failure ends the wait: the caller then reduces everything
        # itself, and the other segments are no use any more.
        results = await all_or_cancel(
            [
                self.roots.run(value, spec_msgs[mine]),
                *(
                    self.pull_copy(spec_msgs[i], specs[i].copies.index(me))
                    for i in range(len(specs))
                    if i != mine
                ),
            ],
            "allreduce segment",
        )
        order = [mine, *(i for i in range(len(specs)) if i != mine)]
        shape = flat_shape(value, specs[mine].inputs[specs[mine].root])
        return self._assemble(shape, specs, order, results)

    def _assemble(
        self,
        shape: tuple[int, ...],
        specs: list[ReduceSpec],
        order: list[int],
        segments: list[np.ndarray],
    ) -> np.ndarray:
        """The whole result of ``shape`` from its segments (``order``: the
        segment index of each of ``segments``)."""
        first = segments[0]
        # From the buffer pool: fresh memory would be faulted in page by page
        # (measured: as much CPU as receiving the segments). The region goes
        # back to the pool when the result array dies (memoryview -> handle).
        count = math.prod(shape)
        mem = memoryview(self.ctx.store.pool.allocate(count * first.dtype.itemsize))  # type: ignore[arg-type]
        flat = np.frombuffer(mem, dtype=first.dtype, count=count)
        return join_segments(shape, [specs[i] for i in order], segments, out=flat)

    async def reduce_anew(self, spec: ReduceSpec, slot: int, value: Any) -> Any:
        """The failure path of allreduce: the whole reduction of ``spec``'s
        inputs, as a plain (restartable) reduce tree rooted here with input
        ``slot`` (``value``: this worker's copy of it, or None to find one)."""
        w = self.ctx.worker
        self.ctx.event("allreduce-fallbacks", rid=spec.rid)
        n = len(spec.inputs)
        if value is None:
            local = [i for i, k in enumerate(spec.inputs) if k in w.data]
            if local:
                slot, value = local[0], w.data[spec.inputs[local[0]]]
            else:
                key = spec.inputs[slot]
                who_has = await w.scheduler.who_has(keys=[key])
                [value] = await self.fetch_parts([key], {key: list(who_has.get(key) or [])})
        order = [slot, *(i for i in range(n) if i != slot)]  # ``value``'s input first
        keys = [spec.inputs[i] for i in order]
        holders: dict[Key, list[str]] = {}
        for i in order:  # where the plan had each input, and this worker where it holds one
            holders.setdefault(spec.inputs[i], []).append(spec.addresses[i])
            if spec.inputs[i] in w.data:
                holders[spec.inputs[i]].append(w.address)
        size = int(getattr(value, "nbytes", 0) or 0)
        req = PlanRequest(
            rid=uuid.uuid4().hex,
            op=spec.op,
            inputs=tuple(keys),
            k=n,
            min_bytes=0,  # a tree whatever the size: the copies wait on its root
            block_bytes=spec.block_bytes,
            to=w.address,
            root_input=0,  # ``value`` is this input's
        )
        answer = await request_plan(w.scheduler, req, holders, dict.fromkeys(keys, size))
        plan = plan_from_msg(answer["plan"])
        assert isinstance(plan, Tree), plan
        return await self.roots.run(value, plan.spec.to_msg())

    async def pull_copy(self, spec_msg: dict[str, Any], j: int) -> Any:
        """Allreduce copy ``j``: stream the result from the previous copy (or
        the root) while it is being reduced, serve the next copy likewise.
        An abort of the reduction (``hoplite_reduce_abort``) stops only this
        copy's stream, which then fails with an error (not a cancellation of
        its caller)."""
        spec = ReduceSpec.from_msg(spec_msg)
        if self.reductions.is_aborted(spec.rid):
            raise CollectiveAborted(f"reduction {spec.rid} was aborted; no result to copy")
        key = spec.copy_key(j)
        buf = self.ctx.store.announce(key)
        self.reductions.announced(key)
        task = asyncio.create_task(self._pull_copy(spec, j, buf))
        with self.reductions.tracked(spec.rid, task):
            try:
                await asyncio.wait({task})
            except BaseException:  # we were cancelled ourselves
                cancel_quietly([task])
                buf.fail(CollectiveAborted("allreduce copy cancelled"))
                raise
        if task.cancelled():
            error: BaseException = CollectiveAborted(
                f"allreduce copy {j} of {spec.rid} was aborted"
            )
        else:
            error = task.exception()  # type: ignore[assignment]
            if error is None:
                return task.result()
        buf.fail(as_exception(error))
        raise error

    async def _pull_copy(self, spec: ReduceSpec, j: int, buf: ObjectBuffer) -> Any:
        """Stream copy ``j`` into ``buf``; hold it until copy j+1 has it."""
        src_addr, src_key = spec.copy_source(j)
        stall = self.ctx.config.stall_timeout
        hold = j + 1 < len(spec.copies)
        async with self.reductions.held_until_sent(spec.copy_key(j), hold=hold):
            w, start = self.ctx.worker, dask_time()
            with (
                self.ctx.receiving(src_key, src_addr, buf, "object"),
                context_meter.meter("network", func=dask_time),
            ):
                async with pooled_comm(w.rpc, src_addr, stall) as comm:
                    raw = raw_stream(comm) is not None
                    req = StreamRequest(src_key, 0, spec.block_bytes, None, raw=raw, who=w.address)
                    n = await receive_stream(comm, buf, req, stall_timeout=stall)
            if self.ctx.accounting:
                accounting.received(w, src_key, src_addr, start, dask_time(), n)
            self.ctx.count("bytes-received", n)
            result = await self.ctx.deserialize(buf)
        resolve_op(spec.op).finish(result, len(spec.inputs))
        return result
