"""A reduction submitted at once, decided on the cluster.

:func:`dask_hoplite.reduce` returns as fast as ``client.submit``: it submits
two tasks in one graph, a planning task with no dependencies and the result
task, which depends only on the plan. The planning task
(:func:`choose_and_plan`) waits on the cluster for the first ``k`` inputs to be
ready (the scheduler part's ``hoplite_first_ready``; without dask-hoplite,
``as_completed`` on the worker's client), plans with
:mod:`dask_hoplite.core.reduce_plan`, and restricts the result task to the
root's worker (it was submitted with loose restrictions: if that worker dies,
Dask runs it elsewhere). The result task (:func:`run_plan`) runs the reduce
tree rooted there, or fetches the inputs and reduces them in one go.

An input that becomes ready and then loses its holder before the plan is made
is not ready any more: the scheduler recomputes it, and with ``k < n`` a
spare that is ready is chosen instead. An input that cannot come back
(erred, forgotten) when ``k`` can no longer be reached raises an error naming
it; Dask's own :class:`~distributed.KilledWorker` is raised as it is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

from dask.typing import Key
from distributed import KilledWorker
from distributed.protocol import pickle
from distributed.protocol.serialize import Serialized, deserialize
from distributed.worker import Worker

from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import (
    OneTask,
    PlanRequest,
    SplitTrees,
    Tree,
    plan_from_msg,
    plan_reduction,
)
from dask_hoplite.core.reduce_spec import reduce_values
from dask_hoplite.errors import NotRegistered, ReduceInputLost
from dask_hoplite.scheduler.client import METADATA_KEY
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
    """The plan of reduction ``req`` once ``k`` of its inputs are ready; the
    result task is then restricted to the plan's root."""
    if req.to is not None:
        workers = (await w.scheduler.identity())["workers"]
        if req.to not in workers:
            raise ValueError(
                f"to={req.to!r} is not a worker of this cluster; workers: {sorted(workers)}"
            )
    ready = await first_ready(w, req)
    plan = plan_reduction(this_run(req), ready.chosen, ready.who_has, ready.nbytes, ready.net)
    if req.result is not None:
        await w.scheduler.set_restrictions(worker={req.result: [plan.root]})
    return {**plan.to_msg(), TASK_FIELD: req.result}


def this_run(req: PlanRequest) -> PlanRequest:
    """``req`` as one computation of its plan, with an id of its own.

    Each computation of a plan is its own run: Dask computes the plan again
    when the worker holding it dies, and the tasks that run it may then start
    on a new root while the first run goes on; partial results and reduce
    nodes are named after the run, so the two never share them."""
    return dataclasses.replace(req, rid=f"{req.rid}-{uuid.uuid4().hex[:8]}")


@dataclasses.dataclass(frozen=True)
class Ready:
    """The first ``k`` inputs of a request to be ready, where they are, their
    sizes, and the network estimate (None: dask-hoplite is not registered)."""

    chosen: list[Key]
    who_has: dict[Key, list[str]]
    nbytes: dict[Key, int]
    net: NetworkEstimate | None


async def first_ready(w: Worker, req: PlanRequest) -> Ready:
    """The first ``req.k`` of ``req.inputs`` to be ready, waited for on the
    cluster (raising the error of an input that cannot come back)."""
    keys: list[Key] = list(req.inputs)
    registered = await w.scheduler.get_metadata(keys=[METADATA_KEY], default=None)
    if registered is None:
        return Ready(*await _first_ready_without_plugin(w, keys, req.k), None)
    m = await w.scheduler.hoplite_first_ready(keys=keys, k=req.k)
    if "failed" in m:
        await _raise_lost(m["failed"], m["state"], _exception(m.get("exception")))
    return Ready(m["chosen"], m["who_has"], m["nbytes"], NetworkEstimate.from_msg(m["network"]))


async def _first_ready_without_plugin(
    w: Worker, keys: list[Key], k: int, poll: float = 0.05
) -> tuple[list[Key], dict[Key, list[str]], dict[Key, int]]:
    """Dask alone: the first ``k`` of ``keys`` in memory, with holders, by
    asking the scheduler's task states every ``poll`` seconds."""
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
                nbytes = await w.scheduler.nbytes(keys=ready, summary=False)
                return ready, who_has, nbytes
        elif failed and len(keys) - len(failed) < k:
            key = failed[0]
            await _raise_lost(key, states.get(key), None)
        await asyncio.sleep(poll)


def _exception(value: Any) -> BaseException | None:
    """An erred task's exception as the scheduler keeps it (serialized)."""
    if isinstance(value, Serialized):
        value = deserialize(value.header, value.frames)
    if isinstance(value, bytes):
        value = pickle.loads(value)
    return value if isinstance(value, BaseException) else None


async def _raise_lost(key: Key, state: str | None, exception: BaseException | None) -> None:
    """Raise the error of input ``key`` that cannot come back: Dask's
    KilledWorker as it is, any other error named after the input."""
    if isinstance(exception, KilledWorker):
        raise exception
    if state == "erred":
        raise ReduceInputLost(
            f"input {key!r} of the reduction failed: {exception!r}"
            if exception is not None
            else f"input {key!r} of the reduction failed (its future holds the error)"
        ) from exception
    raise ReduceInputLost(
        f"input {key!r} of the reduction is gone and cannot be recomputed "
        f"(scheduler state: {state or 'unknown'}); was it cancelled or released?"
    )


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
