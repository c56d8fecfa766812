"""Every reduction run's plan, made in one place: the scheduler.

A reduce, an allreduce, a dask.array or dask.bag aggregate taken over by a
worker, an allreduce that falls back to a plain tree, and a tree that broke
and restarts all ask :class:`ReductionCoordinator` for their plan. It answers
from the scheduler's own view: which inputs are ready and where
(:class:`~dask_hoplite.scheduler.first_ready.FirstReady`), how big they are,
and the network estimate (:class:`~dask_hoplite.core.network_model.NetworkModel`),
then calls the pure planner (:func:`~dask_hoplite.core.reduce_plan.plan_reduction`
or :func:`~dask_hoplite.core.reduce_plan.relocated_spec`) and pins the tasks the
plan places. The worker shells run what they get; none of them plans.

Each plan is a run of its own, named ``<request id>-<n>`` with ``n`` counted
by the coordinator: Dask computes a planning task again when the worker
holding its result dies, and the second run's partial results and reduce
nodes must never be confused with the first's.

Settings that shape a plan (``min_bytes``, ``block_bytes``, timeouts) come in
the request, from the caller's configuration, never from the scheduler's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.allreduce_outputs import output_keys, output_roles, output_workers
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.core.reduce_plan import PlanRequest, plan_reduction, relocated_spec
from dask_hoplite.core.reduce_spec import ReduceSpec, with_spares
from dask_hoplite.scheduler.first_ready import FirstReady

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

logger = logging.getLogger(__name__)

#: Scheduler states from which a lost input cannot come back.
GONE = (None, "erred", "forgotten")


class ReductionCoordinator:
    """The RPCs ``hoplite_plan_reduction`` and ``hoplite_replan_tree``.

    ``task`` looks a key up in the scheduler's task states; ``workers`` lists
    the workers of the cluster; ``restrict`` pins tasks to workers (the
    scheduler's ``set_restrictions``)."""

    def __init__(
        self,
        first_ready: FirstReady,
        network: NetworkModel,
        task: Callable[[Key], TaskState | None],
        workers: Callable[[], Collection[str]],
        restrict: Callable[[dict[Key, Collection[str] | str | None]], None],
        counter: itertools.count[int] | None = None,
    ) -> None:
        self.first_ready = first_ready
        self.network = network
        self._task = task
        self._workers = workers
        self._restrict = restrict
        #: Numbers the runs; kept when the plugin is registered again.
        self.counter = itertools.count(1) if counter is None else counter

    def run_id(self, rid: str) -> str:
        """A new run of request ``rid``."""
        return f"{rid}-{next(self.counter)}"

    # ------------------------------------------------------------ planning

    async def plan_reduction(
        self,
        request: dict[str, Any],
        who_has: dict[Key, list[str]] | None = None,
        nbytes: dict[Key, int] | None = None,
    ) -> dict[str, Any]:
        """Plan a new run of ``request`` (a :meth:`PlanRequest.to_msg`).

        Without ``who_has``, once ``k`` of its inputs are ready: the first
        ``k`` to be ready are reduced, where the scheduler has them; with
        ``who_has`` (and ``nbytes``), the request's inputs, all of them, where
        the caller says. The result task (``result``) is pinned to the plan's
        root; for an allreduce, output ``i`` to the worker of input ``i``.

        Answers ``{"plan": ...}`` (and, for an allreduce, ``"roles"``,
        ``"outputs"``, ``"workers"``); ``{"error": text}`` for a request that
        names no worker of the cluster; ``{"failed": key, "state", "exception"}``
        when so many inputs cannot come back that ``k`` never will."""
        req = PlanRequest.from_msg(request)
        if req.to is not None and req.to not in self._workers():
            return {
                "error": f"to={req.to!r} is not a worker of this cluster; "
                f"workers: {sorted(self._workers())}"
            }
        if who_has is None:
            ready = await self.first_ready.first_ready(list(req.inputs), req.k)
            if "failed" in ready:
                return ready
            chosen, who_has, nbytes = ready["chosen"], ready["who_has"], ready["nbytes"]
        else:
            chosen = list(req.inputs)
        assert nbytes is not None, "who_has goes with nbytes"
        plan = plan_reduction(
            dataclasses.replace(req, rid=self.run_id(req.rid)),
            chosen,
            who_has,
            nbytes,
            self.network.estimate(),
        )
        answer: dict[str, Any] = {"plan": plan.to_msg()}
        if req.allreduce:
            workers = output_workers(req.inputs, who_has)
            self._restrict(dict(zip(output_keys(req), ([a] for a in workers), strict=True)))
            answer.update(
                roles=output_roles(plan, workers), outputs=output_keys(req), workers=workers
            )
        elif req.result is not None:
            self._restrict({req.result: [plan.root]})
        return answer

    async def replan_tree(
        self,
        spec: dict[str, Any],
        root: str,
        avoid: Sequence[str] = (),
        queue_timeout: float = 300.0,
        stall_timeout: float = 10.0,
        poll: float = 0.1,
    ) -> dict[str, Any]:
        """Tree ``spec`` (a :meth:`ReduceSpec.to_msg`) as a new run rooted on
        ``root``, with every input where it is now.

        A lost input that a ready spare can stand in for is replaced by it
        (``"swaps"``: ``[lost, spare]`` pairs); any other lost input is waited
        for while the scheduler recomputes it. A worker in ``avoid`` just
        failed: it is often dead but not yet removed, so for ``stall_timeout``
        an input it alone holds is waited for too, then it is used if it is
        still the only holder. Answers ``{"spec", "swaps"}``, or
        ``{"failed": key, "state": ..., "why": text}`` for an input that
        cannot come back or whose state stays the same for ``queue_timeout``."""
        old = ReduceSpec.from_msg(spec)
        shun = set(avoid)
        swaps: dict[Key, Key] = {}
        if old.spares:
            old, swaps = with_spares(old, self._who_has([*old.inputs, *old.spares]), shun)
        keys = list(old.inputs)
        shun_until = time.monotonic() + stall_timeout
        while True:
            waited = await self._holders(keys, queue_timeout, poll)
            if "failed" in waited:
                return waited
            who_has = waited["who_has"]
            shunned = [
                k for slot, k in enumerate(keys) if slot != old.root and set(who_has[k]) <= shun
            ]
            if not shunned or time.monotonic() > shun_until:
                break
            await asyncio.sleep(poll)
        new = relocated_spec(old, who_has, shun, root, self.run_id(old.reduction_rid))
        return {"spec": new.to_msg(), "swaps": [[lost, spare] for lost, spare in swaps.items()]}

    # ------------------------------------------------------------- helpers

    def _who_has(self, keys: Sequence[Key]) -> dict[Key, list[str]]:
        out: dict[Key, list[str]] = {}
        for key in keys:
            ts = self._task(key)
            out[key] = sorted(ws.address for ws in (ts.who_has or ())) if ts is not None else []
        return out

    async def _holders(self, keys: list[Key], queue_timeout: float, poll: float) -> dict[str, Any]:
        """``{"who_has"}`` as soon as every key has a holder, waiting while
        the scheduler recomputes the ones that have none, as long as their
        states keep changing within ``queue_timeout``; ``{"failed", "state",
        "why"}`` for a key that cannot come back or stays put."""
        deadline = time.monotonic() + queue_timeout
        last: dict[Key, str | None] = {}
        while True:
            who_has = self._who_has(keys)
            pending = [k for k in keys if not who_has[k]]
            if not pending:
                return {"who_has": who_has}
            states = {k: _state(self._task(k)) for k in pending}
            for key, state in states.items():
                if state in GONE:
                    why = (
                        f"input {key!r} of the reduction was lost and cannot be recomputed "
                        f"(scheduler state: {state or 'unknown'})"
                    )
                    return {"failed": key, "state": state, "why": why}
            if states != last:
                last, deadline = states, time.monotonic() + queue_timeout
            elif time.monotonic() > deadline:
                key = pending[0]
                why = (
                    f"input {key!r} of the reduction has no holder (scheduler state "
                    f"{states[key]!r}) and nothing changed for {queue_timeout:g}s"
                )
                return {"failed": key, "state": states[key], "why": why}
            await asyncio.sleep(poll)


def _state(ts: TaskState | None) -> str | None:
    return None if ts is None else ts.state


def who_has_msg(who_has: Mapping[Key, Sequence[str]]) -> dict[Key, list[str]]:
    """``who_has`` as an RPC argument (lists, not tuples or sets)."""
    return {key: list(holders) for key, holders in who_has.items()}
