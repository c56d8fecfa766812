"""The takeover of dask.array / dask.bag aggregate tasks on the worker.

The scheduler part rewrites the aggregates of array reductions and bag folds
into tasks whose function is a :class:`~dask_hoplite.graph_reductions.rewrite.GraphReduce`
(see that module). When such a task arrives here with large parts held
elsewhere, :class:`AggregateTakeover` rewrites the ``ComputeTaskEvent`` before
Dask's state machine sees it: the task no longer depends on fetching its parts
here; it reduces them where they live with a reduce tree rooted on this
worker, then runs the aggregate's own finishing step. On any failure of the
tree the parts are fetched and Dask's own aggregate runs on them.

It overrides ``Worker.handle_stimulus`` on the worker instance
(:meth:`install` returns the patch that undoes it).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask._task_spec import Task
from dask.typing import Key
from distributed import Reschedule
from distributed.worker import Worker
from distributed.worker_state_machine import StateMachineEvent

from dask_hoplite.compat import private
from dask_hoplite.core.reduce_plan import PlanRequest, Tree, is_small, plan_from_msg
from dask_hoplite.core.reduce_spec import check_input, select_field
from dask_hoplite.errors import ReduceInputError
from dask_hoplite.graph_reductions.rewrite import GraphReduce
from dask_hoplite.patching import AttributePatch
from dask_hoplite.scheduler_calls import request_plan
from dask_hoplite.worker.context import FetchParts, WorkerContext, all_or_cancel, run_on_loop
from dask_hoplite.worker.reduce_root import ReduceRoots

if TYPE_CHECKING:
    from distributed.worker_state_machine import ComputeTaskEvent
else:  # a name a release dropped turns off its feature, not this import
    ComputeTaskEvent = private("distributed.worker_state_machine", "ComputeTaskEvent")

logger = logging.getLogger(__name__)


class AggregateTakeover:
    """Runs rewritten array/bag aggregates as reduce trees over their parts."""

    def __init__(self, ctx: WorkerContext, roots: ReduceRoots, fetch_parts: FetchParts) -> None:
        self.ctx = ctx
        self.roots = roots
        self.fetch_parts = fetch_parts
        self._original: Callable[..., None] | None = None

    def install(self, worker: Worker) -> AttributePatch:
        """Take over ``worker.handle_stimulus``; the patch undoes it."""
        self._original = worker.handle_stimulus
        return AttributePatch(worker, "handle_stimulus", self.handle_stimulus)

    def handle_stimulus(self, *stims: StateMachineEvent) -> None:
        """Dask's ``Worker.handle_stimulus``, with the aggregate tasks taken
        over when their inputs are large."""
        assert self._original is not None
        self._original(*(self._take_over(ev) for ev in stims))

    def _take_over(self, ev: StateMachineEvent) -> StateMachineEvent:
        if not isinstance(ev, ComputeTaskEvent) or self.ctx.closed:
            return ev
        spec = ev.run_spec
        fn = getattr(spec, "func", None)
        if not isinstance(spec, Task) or not isinstance(fn, GraphReduce):
            return ev
        keys = [a.key for a in spec.args]  # TaskRefs, in the order of the parts
        me = self.ctx.address
        if (
            len(keys) < 2
            or set(keys) != set(ev.who_has)
            or is_small(max(ev.nbytes.values(), default=0), self.ctx.config.min_bytes)
            or all(me in ev.who_has[k] for k in keys)
        ):
            return ev
        who_has = {k: list(v) for k, v in ev.who_has.items()}
        run = functools.partial(self._run, fn, keys, who_has, dict(ev.nbytes))
        self.ctx.count("graph-reductions")
        logger.debug("%r: reducing %d inputs where they live", ev.key, len(keys))
        return dataclasses.replace(ev, who_has={}, nbytes={}, run_spec=Task(ev.key, run))

    def _run(
        self,
        fn: GraphReduce,
        keys: list[Key],
        who_has: dict[Key, list[str]],
        nbytes: dict[Key, int],
    ) -> Any:
        """The task this worker runs in place of an aggregate it took over:
        a reduce tree over the parts where they live, then the aggregate's own
        finishing step; on any failure of the tree, Dask's way (fetch the
        parts here, run the aggregate)."""
        w = self.ctx.worker
        if self.ctx.closed:  # the plugin went away after the task arrived
            raise Reschedule()
        try:
            combined = run_on_loop(w, self.reduce_parts, fn, keys, who_has, nbytes)
            return fn.finish(combined)
        except ReduceInputError as e:
            logger.info("%r: computing the aggregate on fetched inputs (%s)", fn, e)
        except Exception as e:
            logger.warning(
                "%r: reduce tree failed (%s: %s); fetching the inputs", fn, type(e).__name__, e
            )
        self.ctx.event("graph-reduction-fallbacks", function=repr(fn))
        values = run_on_loop(w, self.fetch_parts, keys, who_has, seceded=True)
        return fn(*values)

    async def reduce_parts(
        self,
        fn: GraphReduce,
        keys: list[Key],
        who_has: dict[Key, list[str]],
        nbytes: dict[Key, int],
    ) -> Any:
        """Combine the parts ``keys`` elementwise with a reduce tree rooted
        here; returns the combined part (a dict of arrays for dict parts).
        Raises :class:`ReduceInputError` when the parts do not suit a tree (the
        caller then runs Dask's own aggregate on fetched parts)."""
        w = self.ctx.worker
        me = w.address
        if not any(me in who_has[k] for k in keys):
            raise ReduceInputError("no input of the reduction is on this worker")
        cfg = self.ctx.config
        req = PlanRequest(
            rid=uuid.uuid4().hex,
            op=fn.op,
            inputs=tuple(keys),
            k=len(keys),
            min_bytes=cfg.min_bytes,
            block_bytes=cfg.block_bytes,
            to=me,  # a local part at the root: its value is the root's operand
            leaves=fn.fields or (None,),
        )
        answer = await request_plan(w.scheduler, req, who_has, nbytes)
        plan = plan_from_msg(answer["plan"])
        assert isinstance(plan, Tree), plan  # large parts, one result here
        specs = plan.leaf_specs()
        root_key = plan.spec.inputs[plan.spec.root]
        operands = []
        for spec in specs:
            operand = check_input(select_field(w.data[root_key], spec.field, root_key), root_key)
            if not fn.accepts(operand.dtype):
                raise ReduceInputError(f"{fn!r} does not combine {operand.dtype} parts")
            if not fn.parts_fit(operand.shape):
                raise ReduceInputError(f"input {root_key!r} has extent != 1 along the reduced axes")
            operands.append(operand)
        results = await all_or_cancel(
            (self.roots.run(v, sp.to_msg()) for v, sp in zip(operands, specs, strict=True)),
            "reduce of a field",
        )
        return results[0] if fn.fields is None else dict(zip(fn.fields, results, strict=True))
