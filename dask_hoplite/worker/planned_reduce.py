"""A reduction submitted at once, decided on the cluster.

:func:`dask_hoplite.reduce` returns as fast as ``client.submit``: it submits
two tasks in one graph, a planning task with no dependencies and the result
task, which depends only on the plan. The planning task
(:func:`choose_and_plan`) waits on the cluster for the first ``k`` inputs to be
ready and plans: it asks the scheduler's reduction coordinator
(:mod:`dask_hoplite.scheduler.reduction_coordinator`), which restricts the
result task to the root's worker (it was submitted with loose restrictions:
if that worker dies, Dask runs it elsewhere); without dask-hoplite, it polls
the scheduler's task states and takes
:func:`~dask_hoplite.core.reduce_plan.plan_without_hoplite`. The result task
(:func:`run_plan`) runs the reduce tree rooted there, or fetches the inputs
and reduces them in one go.

An input that becomes ready and then loses its holder before the plan is made
is not ready any more: the scheduler recomputes it, and with ``k < n`` a
spare that is ready is chosen instead. An input that cannot come back
(erred, forgotten) when ``k`` can no longer be reached raises an error naming
it; Dask's own :class:`~distributed.KilledWorker` is raised as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from dask.typing import Key
from distributed.worker import Worker

from dask_hoplite.core.reduce_plan import (
    OneTask,
    Plan,
    PlanRequest,
    SplitTrees,
    Tree,
    plan_from_msg,
    plan_without_hoplite,
    unknown_to,
)
from dask_hoplite.core.reduce_spec import reduce_values
from dask_hoplite.errors import NotRegistered
from dask_hoplite.scheduler_calls import METADATA_KEY, raise_lost, request_plan
from dask_hoplite.worker.context import PLUGIN_NAME
from dask_hoplite.worker.receiver import get_data_or_reschedule

#: The field of a reduction's plan message naming its result task (whose key,
#: once cancelled, stops the reduction: :mod:`.running_tasks`).
TASK_FIELD = "task"


def running_part(w: Worker) -> Any:
    """The running worker part (:class:`~dask_hoplite.worker.plugin.WorkerParts`)
    or None where dask-hoplite is not installed."""
    plugin = w.plugins.get(PLUGIN_NAME)
    running = plugin is not None and getattr(plugin, "running", False)
    return getattr(plugin, "parts", None) if running else None


async def choose_and_plan(w: Worker, req: PlanRequest) -> dict[str, Any]:
    """The plan of reduction ``req`` once ``k`` of its inputs are ready, made
    by the scheduler's reduction coordinator, which restricts the result task
    to the plan's root."""
    plan: Plan
    if await w.scheduler.get_metadata(keys=[METADATA_KEY], default=None) is None:
        plan = await _plan_without_hoplite(w, req)
    else:
        answer = await request_plan(w.scheduler, req)
        plan = plan_from_msg(answer["plan"])
    return {**plan.to_msg(), TASK_FIELD: req.result}


async def _plan_without_hoplite(w: Worker, req: PlanRequest) -> OneTask:
    """Dask alone: one task on the result's worker reduces the first ``k``
    inputs to be ready."""
    if req.to is not None:
        error = unknown_to(req.to, (await w.scheduler.identity())["workers"])
        if error is not None:
            raise ValueError(error)
    ready = await first_ready_without_hoplite(w, req)
    plan = plan_without_hoplite(req, ready.chosen, ready.who_has)
    if req.result is not None:
        await w.scheduler.set_restrictions(worker={req.result: [plan.root]})
    return plan


@dataclasses.dataclass(frozen=True)
class Ready:
    """The first ``k`` inputs of a request to be ready and where they are."""

    chosen: list[Key]
    who_has: dict[Key, list[str]]


async def first_ready(w: Worker, req: PlanRequest) -> Ready:
    """The first ``req.k`` of ``req.inputs`` to be ready, waited for on the
    cluster (raising the error of an input that cannot come back)."""
    keys: list[Key] = list(req.inputs)
    registered = await w.scheduler.get_metadata(keys=[METADATA_KEY], default=None)
    if registered is None:
        return await first_ready_without_hoplite(w, req)
    m = await w.scheduler.hoplite_first_ready(keys=keys, k=req.k)
    if "failed" in m:
        await raise_lost(m["failed"], m["state"], m.get("exception"))
    return Ready(m["chosen"], m["who_has"])


async def first_ready_without_hoplite(w: Worker, req: PlanRequest, poll: float = 0.05) -> Ready:
    """Dask alone: the first ``req.k`` of ``req.inputs`` in memory, with
    holders, by asking the scheduler's task states every ``poll`` seconds."""
    keys: list[Key] = list(req.inputs)
    k = req.k
    seen: dict[Key, None] = {}  # ready keys, in the order first seen ready
    while True:
        states = await w.scheduler.get_task_status(keys=keys)
        failed = [key for key in keys if states.get(key) in (None, "erred", "forgotten")]
        for key in keys:
            if states.get(key) == "memory":
                seen.setdefault(key)
            else:
                seen.pop(key, None)
        ready = [key for key in seen for _ in range(keys.count(key))][:k]
        if len(ready) == k:
            who_has = await w.scheduler.who_has(keys=ready)
            if all(who_has.get(key) for key in ready):
                return Ready(ready, who_has)
        elif failed and len(keys) - len(failed) < k:
            key = failed[0]
            await raise_lost(key, states.get(key), None)
        await asyncio.sleep(poll)


async def run_plan(w: Worker, plan_msg: dict[str, Any]) -> Any:
    """The result of reduction ``plan_msg`` (this is its result task)."""
    plan = plan_from_msg(plan_msg)
    part = running_part(w)
    if isinstance(plan, OneTask):
        chosen = list(plan.chosen)
        return reduce_values(plan.op, chosen, await fetch_values(w, part, chosen))
    if part is None:
        raise NotRegistered.on_worker(w.address)
    if isinstance(plan, Tree):
        [value] = await fetch_values(w, part, [plan.spec.inputs[plan.spec.root]])
        return await part.roots.run(value, plan.spec.to_msg(), plan_msg.get(TASK_FIELD))
    if isinstance(plan, SplitTrees):
        first = plan.specs[0]
        [value] = await fetch_values(w, part, [first.inputs[first.root]])
        return await part.roots.run_segments(value, [s.to_msg() for s in plan.specs])
    raise TypeError(f"a reduction's result task does not run a {type(plan).__name__}")


async def fetch_values(w: Worker, part: Any, keys: list[Key]) -> list[Any]:
    """The values of ``keys`` on this worker: from memory, through hoplite
    where it runs, else from a holder with Dask's ``get_data``; reschedules
    the task when an input has no holder left (Dask recomputes it first)."""
    missing = [key for key in dict.fromkeys(keys) if key not in w.data]
    who_has = await w.scheduler.who_has(keys=missing) if missing else {}
    if part is not None:
        return list(await part.receiver.fetch_parts(list(keys), who_has))
    out = {key: w.data[key] for key in keys if key in w.data}
    for key in missing:
        out[key] = await get_data_or_reschedule(w, key, who_has.get(key) or ())
    return [out[key] for key in keys]
