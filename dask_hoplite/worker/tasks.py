"""The functions the collectives submit as Dask tasks.

:mod:`dask_hoplite.collectives` submits these (pickled by reference) to the
workers that hold the inputs; each finds the worker part on the worker it runs
on and hands over to it: the root of a reduction, an allreduce copy, a part of
a segmented allreduce, a small allreduce's copy.
"""

from __future__ import annotations

from typing import Any

from distributed import get_worker
from distributed.worker import Worker

from dask_hoplite.core.reduce_plan import (
    AllreduceTree,
    PlanRequest,
    SegmentedAllreduce,
    Tree,
    plan_from_msg,
)
from dask_hoplite.errors import NotRegistered
from dask_hoplite.worker import planned_reduce
from dask_hoplite.worker.context import PLUGIN_NAME, run_on_loop, secede_coroutine
from dask_hoplite.worker.plugin import HopliteWorker, WorkerParts


def worker_part(w: Worker) -> WorkerParts:
    """Worker ``w``'s hoplite components, or a clear error if the worker part
    is not installed there."""
    plugin = w.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, HopliteWorker) or not plugin.running:
        raise NotRegistered.on_worker(w.address)
    return plugin.parts


async def plan_reduce(req: PlanRequest) -> dict[str, Any]:
    """The planning task of a reduction: waits on the cluster for its first k
    inputs and returns the plan (a coroutine: it waits on the event loop, and
    leaves the worker's thread slots first: the inputs it waits for may need
    the slot, e.g. with one thread per worker)."""
    w = get_worker()
    secede_coroutine(w, req.plan_key)
    return await planned_reduce.choose_and_plan(w, req)


async def run_reduce(plan: dict[str, Any]) -> Any:
    """The result task of a reduction: runs ``plan`` on the root's worker."""
    return await planned_reduce.run_plan(get_worker(), plan)


def tree_root(value: Any, plan_msg: dict[str, Any]) -> Any:
    """The root of a plain reduce tree (runs on the root input's worker)."""
    w = get_worker()
    plan = plan_from_msg(plan_msg)
    assert isinstance(plan, Tree), plan
    return run_on_loop(w, worker_part(w).roots.run, value, plan.spec.to_msg())


def allreduce_root(value: Any, plan_msg: dict[str, Any]) -> Any:
    """The root of an allreduce's tree (runs on the root input's worker)."""
    w = get_worker()
    plan = plan_from_msg(plan_msg)
    assert isinstance(plan, AllreduceTree), plan
    return run_on_loop(w, worker_part(w).allreduce.run_root, value, plan.spec.to_msg())


def allreduce_copy(plan_msg: dict[str, Any], j: int) -> Any:
    """Copy ``j`` of an allreduce's tree (runs on that copy's worker)."""
    w = get_worker()
    plan = plan_from_msg(plan_msg)
    assert isinstance(plan, AllreduceTree), plan
    return run_on_loop(w, worker_part(w).allreduce.run_copy, plan.spec.to_msg(), j)


def allreduce_part(value: Any, plan_msg: dict[str, Any], i: int) -> Any:
    """Part ``i`` of a segmented allreduce (runs on the i-th worker)."""
    w = get_worker()
    plan = plan_from_msg(plan_msg)
    assert isinstance(plan, SegmentedAllreduce), plan
    specs = [s.to_msg() for s in plan.specs]
    return run_on_loop(w, worker_part(w).allreduce.run_part, value, specs, i)


async def small_copy(req: dict[str, Any]) -> Any:
    """A small allreduce's copy (runs on the copy's worker). A coroutine: Dask
    runs it on the worker's event loop, with no thread to hand over to and
    back, and cancels it when the copy is released."""
    return await worker_part(get_worker()).small_allreduce.pull_result(
        req["result"], req["root"], req["op"], req["inputs"], req["key"]
    )
