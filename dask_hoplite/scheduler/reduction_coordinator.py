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

Each plan is a run of its own, named ``<request id>-r<n>`` with ``n`` counted
by the coordinator (:func:`~dask_hoplite.core.reduce_spec.run_rid`): Dask
computes a planning task again when the worker holding its result dies, and
a broken tree restarts, and the second run's partial results and reduce nodes
must never be confused with the first's. A worker that has seen run ``n`` of
a tree refuses messages of its earlier runs
(:meth:`~dask_hoplite.worker.reductions.RunningReductions.refusal`).

Settings that shape a plan (``min_bytes``, ``block_bytes``, timeouts) come in
the request, from the caller's configuration, never from the scheduler's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.allreduce_outputs import output_keys, output_roles, output_workers
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.core.reduce_plan import PlanRequest, plan_reduction, relocated_spec, unknown_to
from dask_hoplite.core.reduce_spec import (
    LatestRuns,
    ReduceSpec,
    run_name,
    run_rid,
    with_spares,
)
from dask_hoplite.errors import ReduceInputLost
from dask_hoplite.scheduler.first_ready import FirstReady
from dask_hoplite.scheduler.gc_paused import gc_paused
from dask_hoplite.scheduler_calls import wait_for_holders

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

logger = logging.getLogger(__name__)


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
        latest: LatestRuns | None = None,
    ) -> None:
        self.first_ready = first_ready
        self.network = network
        self._task = task
        self._workers = workers
        self._restrict = restrict
        self._answers = _OwnAnswers(task)
        #: Numbers the runs; kept when the plugin is registered again.
        self.counter = itertools.count(1) if counter is None else counter
        #: The latest run number given to each tree (a request, or a
        #: request's segment restarted on its own), the oldest forgotten
        #: first; kept when the plugin is registered again.
        self.latest = LatestRuns() if latest is None else latest

    def run_id(self, request: str) -> str:
        """A new run of request ``request``."""
        return run_rid(request, self._number(request))

    def _number(self, tree: str) -> int:
        """The next run's number, for ``tree``: a request, or one tree of a
        request's run (a segment or a pytree leaf) restarted on its own."""
        n = next(self.counter)
        self.latest.record(tree, n)
        return n

    def superseded(self, rid: str) -> str | None:
        """Why tree ``rid`` may not run again (None: it may): a later run of
        its request, or of this one tree of it, was planned since."""
        run = run_name(rid)
        if run is None:
            return None
        latest = max(self.latest.get(run.request) or 0, self.latest.get(run.tree) or 0)
        if run.number < latest:
            return f"reduction run {rid} is stale: run {latest} of the same tree was planned since"
        return None

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
        # The synchronous stretches run with collection paused
        # (:mod:`~dask_hoplite.scheduler.gc_paused`): with every input ready,
        # the whole call is one of them.
        with gc_paused():
            req = PlanRequest.from_msg(request)
            error = None if req.to is None else unknown_to(req.to, self._workers())
            if error is not None:
                return {"error": error}
            if who_has is not None:
                assert nbytes is not None, "who_has goes with nbytes"
                return self._plan(req, list(req.inputs), who_has, nbytes)
            ready = self.first_ready.now(list(req.inputs), req.k)
            if ready is not None:
                return self._plan_ready(req, ready)
        ready = await self.first_ready.first_ready(list(req.inputs), req.k)
        with gc_paused():
            return self._plan_ready(req, ready)

    def _plan_ready(self, req: PlanRequest, ready: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_plan` over :meth:`FirstReady.first_ready`'s answer (its
        ``failed`` answer as it is)."""
        if "failed" in ready:
            return ready
        return self._plan(req, ready["chosen"], ready["who_has"], ready["nbytes"])

    def _plan(
        self,
        req: PlanRequest,
        chosen: list[Key],
        who_has: dict[Key, list[str]],
        nbytes: dict[Key, int],
    ) -> dict[str, Any]:
        """A new run of ``req`` over ``chosen``, its plan's message, and the
        result task (or an allreduce's outputs) pinned where the plan says."""
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
        supersede: bool = False,
    ) -> dict[str, Any]:
        """Tree ``spec`` (a :meth:`ReduceSpec.to_msg`) as a new run rooted on
        ``root``, with every input where it is now.

        A lost input that a ready spare can stand in for is replaced by it
        (``"swaps"``: ``[lost, spare]`` pairs); any other lost input is waited
        for while the scheduler recomputes it. A worker in ``avoid`` just
        failed: it is often dead but not yet removed, so for ``stall_timeout``
        an input it alone holds is waited for too, then it is used if it is
        still the only holder. Answers ``{"spec", "swaps"}``; ``{"failed":
        why}`` for an input that cannot come back or whose state stays the
        same for ``queue_timeout`` (waited for as a worker would,
        :func:`~dask_hoplite.scheduler_calls.wait_for_holders`); ``{"stale":
        why}`` for a run superseded by a later one (:meth:`superseded`), but not
        with ``supersede``: the caller is a result task Dask started (again),
        the live run whatever ran before it."""
        old = ReduceSpec.from_msg(spec)
        stale = None if supersede else self.superseded(old.rid)
        if stale is not None:
            logger.warning("refused to restart a superseded run: %s", stale)
            return {"stale": stale}
        shun = set(avoid)
        swaps: dict[Key, Key] = {}
        if old.spares:
            old, swaps = with_spares(old, self._answers.holders([*old.inputs, *old.spares]), shun)
        keys = list(old.inputs)
        shun_until = time.monotonic() + stall_timeout
        while True:
            try:
                who_has = await wait_for_holders(
                    self._answers,
                    keys,
                    lambda _, holders: bool(holders),
                    queue_timeout=queue_timeout,
                    poll=poll,
                )
            except ReduceInputLost as e:
                return {"failed": str(e)}
            shunned = [
                k for slot, k in enumerate(keys) if slot != old.root and set(who_has[k]) <= shun
            ]
            if not shunned or time.monotonic() > shun_until:
                break
            await asyncio.sleep(poll)
        run = run_name(old.rid)
        if run is None:
            rid = self.run_id(old.reduction_rid)
        elif old.segment is None:
            rid = run.later(self._number(run.tree))
        else:  # relocated_spec appends the segment's tag
            rid = run_rid(run.request, self._number(run.tree))
        new = relocated_spec(old, who_has, shun, root, rid)
        return {"spec": new.to_msg(), "swaps": [[lost, spare] for lost, spare in swaps.items()]}


class _OwnAnswers:
    """What :func:`~dask_hoplite.scheduler_calls.wait_for_holders` asks the
    scheduler (``who_has``, ``hoplite_key_states``), answered from its own
    task states: the coordinator waits with the same loop as a worker would."""

    def __init__(self, task: Callable[[Key], TaskState | None]) -> None:
        self._task = task

    def holders(self, keys: Sequence[Key]) -> dict[Key, list[str]]:
        """The workers holding each of ``keys``, sorted (none: not in memory)."""
        out: dict[Key, list[str]] = {}
        for key in keys:
            ts = self._task(key)
            out[key] = sorted(ws.address for ws in (ts.who_has or ())) if ts is not None else []
        return out

    async def who_has(self, keys: list[Key]) -> dict[Key, list[str]]:
        return self.holders(keys)

    async def hoplite_key_states(self, keys: list[Key]) -> dict[Key, str | None]:
        return {k: _state(self._task(k)) for k in keys}


def _state(ts: TaskState | None) -> str | None:
    return None if ts is None else ts.state
