"""Allreduce and allgather submitted at once, decided on the cluster.

:func:`dask_hoplite.allreduce` and :func:`dask_hoplite.allgather` return as
fast as ``client.submit``: one graph of a planning task with no dependencies
and one output task per input. The planning task waits on the cluster for
every input to be ready and restricts output ``i`` to the worker that holds
input ``i`` (loosely: if that worker dies, Dask runs it elsewhere); for an
allreduce, the scheduler's reduction coordinator
(:mod:`dask_hoplite.scheduler.reduction_coordinator`) does both, plans, and
gives each output its role (:mod:`dask_hoplite.core.allreduce_outputs`).
Each output task then runs its role (:func:`run_allreduce_output`); an
allgather's outputs are ordinary tasks that depend on the inputs, which Dask
fetches (through hoplite's streams where it runs).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from dask.typing import Key
from distributed.worker import Worker

from dask_hoplite.core.allreduce_outputs import output_keys, output_roles, output_workers
from dask_hoplite.core.reduce_plan import (
    AllreduceTree,
    PlanRequest,
    SegmentedAllreduce,
    plan_from_msg,
    plan_without_hoplite,
)
from dask_hoplite.core.reduce_spec import as_input, reduce_values
from dask_hoplite.errors import NotRegistered
from dask_hoplite.scheduler_calls import METADATA_KEY, request_plan
from dask_hoplite.worker.context import secede_coroutine
from dask_hoplite.worker.planned_reduce import (
    fetch_values,
    first_ready,
    first_ready_without_hoplite,
    run_plan,
    running_part,
)
from dask_hoplite.worker.receiver import get_data_or_reschedule
from dask_hoplite.worker.small_allreduce import COMING


async def plan_allreduce(w: Worker, req: PlanRequest) -> dict[str, Any]:
    """The planning task of an allreduce: once every input is ready, its plan,
    each output's role and worker; output ``i`` is restricted to that worker
    (by the scheduler's reduction coordinator, where dask-hoplite runs)."""
    secede_coroutine(w, req.plan_key)
    if await w.scheduler.get_metadata(keys=[METADATA_KEY], default=None) is not None:
        answer = await request_plan(w.scheduler, req)
        plan = plan_from_msg(answer["plan"])
        roles, workers = answer["roles"], answer["workers"]
    else:
        ready = await first_ready_without_hoplite(w, req)
        plan = plan_without_hoplite(req, ready.chosen, ready.who_has)
        workers = await _place_outputs(w, req, ready.who_has)
        roles = output_roles(plan, workers)
    return {
        "plan": plan.to_msg(),
        "roles": roles,
        "outputs": output_keys(req),
        "workers": workers,
        "chosen": list(plan.chosen),
        "inputs": list(req.inputs),
    }


async def _place_outputs(w: Worker, req: PlanRequest, who_has: dict[Key, list[str]]) -> list[str]:
    """Restrict output ``i`` of ``req`` to the worker of input ``i`` (loosely,
    as submitted); those workers."""
    workers = output_workers(req.inputs, who_has)
    await w.scheduler.set_restrictions(
        worker={key: [a] for key, a in zip(output_keys(req), workers, strict=True)}
    )
    return workers


async def run_allreduce_output(w: Worker, planned: dict[str, Any], i: int) -> Any:
    """Output ``i`` of a planned allreduce (this is its task): the role the
    plan gave it. It leaves the worker's thread slots first: outputs on one
    worker wait for each other (an alias for the first one, a copy for the
    root's stream)."""
    me = planned["outputs"][i]
    secede_coroutine(w, me)
    plan = plan_from_msg(planned["plan"])
    role = planned["roles"][i]
    part = running_part(w)
    kind = role[0]
    if kind in ("pull", "alias"):
        p = role[1]
        return await _pull(w, part, planned["outputs"][p], planned["workers"][p], plan, me)
    if kind == "reduce" or (kind == "root" and not isinstance(plan, AllreduceTree)):
        return await run_plan(w, planned["plan"])  # one task, or a tree on one worker
    if part is None:
        raise NotRegistered.on_worker(w.address)
    if kind == "root":
        assert isinstance(plan, AllreduceTree), plan
        spec = plan.spec
        [value] = await fetch_values(w, part, [spec.inputs[spec.root]])
        return await part.allreduce.run_root(value, spec.to_msg())
    if kind == "copy":
        assert isinstance(plan, AllreduceTree), plan
        result = await part.allreduce.run_copy(plan.spec.to_msg(), role[1])
        if isinstance(result, np.ndarray):  # streamed flat: a pytree's shape is its input's
            key = planned["inputs"][i]
            [value] = await fetch_values(w, part, [key])  # here, where the output was placed
            result = as_input(value, key, result)
        return result
    if kind == "part":
        assert isinstance(plan, SegmentedAllreduce), plan
        s = role[1]
        [value] = await fetch_values(w, part, [plan.chosen[plan.roots[s]]])
        return await part.allreduce.run_part(value, [x.to_msg() for x in plan.specs], s)
    raise ValueError(f"output {i} of an allreduce has an unknown role {role!r}")


async def _pull(w: Worker, part: Any, key: Key, holder: str, plan: Any, me: Key) -> Any:
    """The value of output ``key``, made on ``holder`` (maybe this worker), as
    soon as it is there; the inputs reduced here if it will not come."""
    inputs = list(plan.chosen)
    if part is not None:
        return await part.small_allreduce.pull_result(key, holder, plan.op, inputs, me)
    return await _pull_without_plugin(w, key, plan.op, inputs)


async def _pull_without_plugin(
    w: Worker, key: Key, op: str, inputs: list[Key], poll: float = 0.05
) -> Any:
    """Dask alone: output ``key`` from its holder once it is in memory (asked
    of the scheduler every ``poll`` seconds); the inputs reduced here if it
    failed or is gone."""
    while key not in w.data:
        state = (await w.scheduler.get_task_status(keys=[key])).get(key)
        if state == "memory":
            holders = (await w.scheduler.who_has(keys=[key])).get(key) or ()
            if holders:
                return await get_data_or_reschedule(w, key, holders)
        elif state not in COMING:
            return reduce_values(op, inputs, await fetch_values(w, None, inputs))
        await asyncio.sleep(poll)
    return w.data[key]


async def place_allgather(w: Worker, req: PlanRequest) -> list[str]:
    """The planning task of an allgather: once every input is ready, output
    ``i`` is restricted to the worker holding input ``i``; returns those
    workers."""
    secede_coroutine(w, req.plan_key)
    ready = await first_ready(w, req)
    return await _place_outputs(w, req, ready.who_has)
