"""The functions the collectives submit as Dask tasks.

:mod:`dask_hoplite.collectives` submits these (pickled by reference); each
finds the worker it runs on and hands over to the module that does the work:
a reduction's planning and result tasks (:mod:`.planned_reduce`), an
allreduce's or allgather's planning task and outputs (:mod:`.planned_outputs`),
a split broadcast's cutting, announcement and copies
(:mod:`dask_hoplite.core.object_parts`), a broadcast's copies and a gather's
list. Every function a collective submits is here, so that a task's key
prefix names what it does, whatever the collective.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

from dask.typing import Key
from distributed import get_worker
from distributed.worker import Worker

from dask_hoplite.core import object_parts
from dask_hoplite.core.reduce_plan import PlanRequest
from dask_hoplite.scheduler_calls import METADATA_KEY
from dask_hoplite.worker import planned_outputs, planned_reduce
from dask_hoplite.worker.context import secede_coroutine

T = TypeVar("T")


async def plan_reduce(req: PlanRequest) -> dict[str, Any]:
    """The planning task of a reduction: waits on the cluster for its first k
    inputs and returns the plan (a coroutine: it waits on the event loop, and
    leaves the worker's thread slots first: the inputs it waits for may need
    the slot, e.g. with one thread per worker)."""
    w = get_worker()
    secede_coroutine(w, req.plan_key)
    return await _as_task(w, req.plan_key, planned_reduce.choose_and_plan(w, req))


async def plan_allreduce(req: PlanRequest) -> dict[str, Any]:
    """The planning task of an allreduce: waits on the cluster for every
    input, plans, and places each output on its input's worker."""
    w = get_worker()
    return await _as_task(w, req.plan_key, planned_outputs.plan_allreduce(w, req))


async def allreduce_output(planned: dict[str, Any], i: int) -> Any:
    """Output ``i`` of an allreduce (runs on input ``i``'s worker)."""
    w = get_worker()
    key = planned["outputs"][i]
    return await _as_task(w, key, planned_outputs.run_allreduce_output(w, planned, i))


async def place_allgather(req: PlanRequest) -> list[str]:
    """The planning task of an allgather: places each output on its input's
    worker once every input is ready."""
    w = get_worker()
    return await _as_task(w, req.plan_key, planned_outputs.place_allgather(w, req))


def gathered(_placed: Any, *values: Any) -> list[Any]:
    """An allgather's output: the list of its inputs (``_placed``: the
    planning task's result, a dependency only so that this task waits for
    its place)."""
    return list(values)


def broadcast_copy(x: Any) -> Any:
    """A broadcast's copy on the worker it runs on: the object, which Dask
    (through hoplite's trees, where registered) fetches there."""
    return x


def gathered_list(*xs: Any) -> list[Any]:
    """A gather's result: its inputs as one list, on the worker asked for."""
    return list(xs)


def split_flat(x: Any) -> Any:
    """A split broadcast's object as one flat array, where it is."""
    return object_parts.flatten(x)


def split_meta(x: Any) -> object_parts.Meta:
    """How to turn a split broadcast's joined parts back into its object."""
    return object_parts.meta_of(x)


def split_part(flat: Any, j: int, parts: int) -> Any:
    """Part ``j`` of a split broadcast's flat array, where it is."""
    return object_parts.part_of(flat, j, parts)


async def announce_split(keys: list[Any], receivers: list[str]) -> None:
    """Tell the directory that ``keys`` are the parts of one split broadcast
    to ``receivers`` (nothing where dask-hoplite is not registered)."""
    w = get_worker()
    if await w.scheduler.get_metadata(keys=[METADATA_KEY], default=None) is not None:
        await w.scheduler.hoplite_plan_split(keys=keys, receivers=receivers)


def join_split_parts(_announced: None, meta: Any, *parts: Any) -> Any:
    """A split broadcast's copy: the parts joined, once announced."""
    return object_parts.join_parts(meta, *parts)


async def run_reduce(plan: dict[str, Any]) -> Any:
    """The result task of a reduction: runs ``plan`` on the root's worker."""
    w = get_worker()
    return await _as_task(w, plan.get(planned_reduce.TASK_FIELD), planned_reduce.run_plan(w, plan))


async def _as_task(w: Worker, key: Key | None, coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result, run as collective task ``key``: where dask-hoplite
    runs, cancelling the key stops it (:mod:`.running_tasks`)."""
    part = planned_reduce.running_part(w)
    if part is None:
        return await coro
    return await part.running_tasks.run(key, coro)
