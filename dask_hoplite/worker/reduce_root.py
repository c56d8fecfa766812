"""The root of a reduce tree, on the worker that holds the root's input.

:class:`TreeRoot` is one running tree: it starts every other node with the
``hoplite_reduce_node`` RPC, runs the root's own node, repairs a node whose
worker died (a parent asks with ``hoplite_reduce_replace``, which the plugin
routes here by reduction id) as its :class:`~dask_hoplite.core.tree_repair.TreeRepair`
decides, replacing or spreading it, and on the first failure it cannot repair
aborts the whole tree and raises the clearest error.

:class:`ReduceRoots` runs a reduction on this worker: a plain reduction whose
tree breaks beyond repair is restarted with its inputs located again (the
scheduler recomputes lost ones from their lineage), up to
``hoplite.resume-attempts`` times. Inputs that do not fit are final.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np
from dask.typing import Key

from dask_hoplite.core.pytrees import is_pytree, layout_of, unpack
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_spec import (
    ReduceSpec,
    as_input,
    join_segments,
    with_root_input,
    with_spares,
)
from dask_hoplite.core.store import ObjectBuffer
from dask_hoplite.core.tree_repair import (
    BreakTree,
    CheckNode,
    Closed,
    FindHolder,
    HolderFound,
    HolderMissing,
    NodeChecked,
    NodeLost,
    Patches,
    Refuse,
    RepairAborted,
    RepairAsked,
    Replace,
    Spread,
    SpreadAnswered,
    SpreadFailed,
    Tick,
    TreeRepair,
    repair_load,
)
from dask_hoplite.errors import (
    CollectiveAborted,
    NodeFailed,
    ReduceInputError,
    StaleRun,
    node_error,
)
from dask_hoplite.scheduler_calls import replan_tree, wait_for_holders
from dask_hoplite.worker.context import WorkerContext, all_or_cancel, cancel_quietly
from dask_hoplite.worker.reduce_node import ReduceNodes
from dask_hoplite.worker.reductions import RunningReductions
from dask_hoplite.worker.tree_spreader import TreeSpreader

logger = logging.getLogger(__name__)

Task = asyncio.Task[Any]


class TreeRoot:
    """One running reduce tree, seen from its root."""

    def __init__(
        self,
        ctx: WorkerContext,
        reductions: RunningReductions,
        nodes: ReduceNodes,
        spec: ReduceSpec,
        into: np.ndarray | None = None,
        lost_with: set[str] | None = None,
    ) -> None:
        self.ctx = ctx
        self.reductions = reductions
        self.nodes = nodes
        self.rid = spec.rid
        #: Workers whose node's input is lost with them, for the restart to
        #: avoid (they may be dead yet still listed as holders for a while).
        self.lost_with = set() if lost_with is None else lost_with
        #: The bytes the root's result is made in (None: pooled memory).
        self.into = into
        #: Decides every repair of this tree; this object carries them out.
        #: A split reduce's segment trees are repaired too; an allreduce is
        #: not. Dead nodes are spread (``hoplite.reduce.repair``: spread, or
        #: auto in a reduce in parts) or replaced.
        self.repair = TreeRepair(
            spec,
            budget=0 if spec.is_allreduce else ctx.config.max_resumes,
            grace=ctx.config.stall_timeout,
            mode=ctx.config.repair_for(in_parts=spec.segment is not None),
        )
        self.spreader = TreeSpreader(ctx)
        #: The node (slot, call generation) each task runs.
        self.slot_of: dict[Task, tuple[int, int]] = {}
        #: The task running each node now (its call to the node's worker).
        self.current: dict[int, Task] = {}
        #: Replacement nodes started, for the supervising loop to wait on.
        self.joined: asyncio.Queue[tuple[tuple[int, int], Task]] = asyncio.Queue()
        self.tasks: set[Task] = set()

    async def run(self, value: Any) -> Any:
        """Run the root node while starting the others; the result.

        A node whose worker died is not a failure yet: its parent asks for a
        replacement (:meth:`replace`), which joins the tree where the dead
        node was. Only if none is asked for within a stall timeout does the
        tree count as broken."""
        spec = self.repair.spec
        refused = self.reductions.refusal(spec.rid, starts=True)
        if refused is not None:
            raise refused if isinstance(refused, StaleRun) else CollectiveAborted(refused)
        for i in range(len(spec.inputs)):
            if i != spec.root:
                t = asyncio.create_task(self._start_node(spec, i))
                self.slot_of[t], self.current[i] = (i, 0), t
        own: asyncio.Task[ObjectBuffer] = asyncio.create_task(
            self.nodes.run(spec, spec.root, value, into=self.into)
        )
        self.tasks = {*self.slot_of, own}
        self.reductions.roots[self.rid] = self
        try:
            failed = await self._supervise(own)
        except BaseException:  # cancelled from outside
            self.repair.handle(Closed())
            self._abort()
            raise
        finally:
            self.repair.handle(Closed())
            self.reductions.roots.pop(self.rid, None)
            while not self.joined.empty():  # a replacement started after the loop's last look
                _, late = self.joined.get_nowait()  # is of no use any more
                self.tasks.add(late)
                cancel_quietly([late])
        if failed:
            self._abort()
            raise self._clearest_error(failed)
        if self.repair.used:
            self.ctx.count("reduce-repairs", self.repair.used)
            self.ctx.event("reduce-repaired", rid=self.rid, nodes=self.repair.used)
        return await self.ctx.deserialize(own.result())

    async def _supervise(self, own: asyncio.Task[ObjectBuffer]) -> list[Task]:
        """Wait for the nodes; the tasks that failed beyond repair.

        Once the root's own node has finished, every node's partial result has
        been streamed up the tree, so the nodes' replies are only waited for
        one stall timeout more (a node whose worker hangs after sending must
        not hold the result back)."""
        stall = self.ctx.config.stall_timeout
        pending = set(self.tasks)
        failed: list[Task] = []
        while pending and not failed:
            own_ok = own.done() and not own.cancelled() and own.exception() is None
            if own_ok:
                # Every partial result reached the root: a node failing now
                # (say, it hung up after sending) changes nothing.
                self.repair.handle(Closed())
            timeout = stall if own_ok else None
            deadline = self.repair.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout or math.inf, deadline - time.monotonic()))
            wake: Task = asyncio.create_task(self.joined.get())
            done, pending = await asyncio.wait(
                pending | {wake}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            pending.discard(wake)
            if wake.done():
                done.discard(wake)
                node, new_task = wake.result()
                self.slot_of[new_task] = node
                self.tasks.add(new_task)
                pending.add(new_task)
            else:
                wake.cancel()
            failed = self._failures(done)
            if not done and own_ok and not wake.done():
                logger.info(
                    "reduction %s: %d node(s) did not confirm within %gs of the result",
                    self.rid,
                    len(pending),
                    stall,
                )
                cancel_quietly(pending)
                break
        return failed

    def _failures(self, done: set[Task]) -> list[Task]:
        """Of the finished ``done``, those that break the tree (the repair
        state decides which node failures wait for a repair), plus the dead
        nodes whose repair was not asked for in time."""
        failed = []
        now = time.monotonic()
        for t in done:
            if t.cancelled() or (e := t.exception()) is None:
                continue
            node = self.slot_of.get(t)
            if node is None:  # the root's own node
                failed.append(t)
                continue
            unreachable = isinstance(e, NodeFailed) and e.unreachable
            for d in self.repair.handle(NodeLost(*node, unreachable=unreachable, now=now)):
                assert isinstance(d, BreakTree), d
                failed.append(t)
            if self.repair.closed:
                logger.info(
                    "reduction %s: node %d failed after the result: %s", self.rid, node[0], e
                )
        for d in self.repair.handle(Tick(now)):
            assert isinstance(d, BreakTree), d
            failed += [self.current[s] for s in d.slots]
        return failed

    def _clearest_error(self, failed: list[Task]) -> BaseException:
        errors = [t.exception() if t.done() and not t.cancelled() else None for t in failed]
        if not any(errors):
            errors = [NodeFailed(f"a node of {self.rid} died and was not replaced", "")]
        return next(
            (e for e in errors if isinstance(e, (ReduceInputError, StaleRun))),
            next(e for e in errors if e is not None),
        )

    async def _start_node(self, spec: ReduceSpec, slot: int, offset: int = 0) -> None:
        """Run node ``slot`` of ``spec`` on its worker, until it is done."""
        addr = spec.addresses[slot]
        try:
            reply = await self.ctx.worker.rpc(addr).hoplite_reduce_node(
                spec=spec.to_msg(), slot=slot, offset=offset
            )
        except Exception as e:
            raise NodeFailed(
                f"node {slot} on {addr}: {type(e).__name__}: {e}", addr, unreachable=True
            ) from e
        error = node_error(reply, addr)
        if error is not None:
            raise error

    def _abort(self) -> None:
        """Stop every node and copy of the tree (this worker's tasks too) and
        drop its partial results here."""
        spec = self.repair.spec
        cancel_quietly(self.tasks)
        rpc = self.ctx.worker.rpc
        # Not waited for: a live peer gets it within a round trip, while a
        # dead one is retried by Dask's connect for comm.timeouts.connect
        # and a hung one never answers. A restart uses a new id anyway.
        self.ctx.spawn(
            asyncio.gather(
                *(
                    rpc(a).hoplite_reduce_abort(rid=spec.rid)
                    for a in set(spec.addresses) | set(spec.copies)
                ),
                return_exceptions=True,
            )
        )
        self.reductions.drop_partials(spec.rid)

    async def replace(self, slot: int, offset: int, dead: str) -> dict[str, Any]:
        """RPC ``hoplite_reduce_replace`` (routed here by id): node ``slot`` on
        worker ``dead`` broke its parent's stream at byte ``offset``. Carries
        out what the repair state decides, feeding it back what each step
        observed, until it gives the reply: a replacement's address (started
        where the input is, waiting while Dask recomputes it), the patches of
        a spread, or a refusal."""
        try:
            return await self._carry_out(RepairAsked(slot, offset, dead))
        except BaseException:  # cancelled, or a step failed unexpectedly
            self.repair.handle(RepairAborted(slot, time.monotonic()))
            raise

    async def _carry_out(self, asked: RepairAsked) -> dict[str, Any]:
        """Carry out the decisions of repair request ``asked`` until its reply."""
        slot = asked.slot
        decisions = self.repair.handle(asked)
        while True:
            [d] = decisions
            if isinstance(d, Refuse):
                logger.info("not repairing node %d of reduction %s: %s", slot, self.rid, d.reason)
                return {"status": "error", "message": d.reason}
            if isinstance(d, Replace):
                return self._start_replacement(d, asked.dead)
            if isinstance(d, Patches):
                return self.spreader.reply(self.repair.spec, d)
            if isinstance(d, CheckNode):
                event: Any = NodeChecked(slot, await self._node_failure(d))
            elif isinstance(d, FindHolder):
                spare = await self._spare_instead(d.key, d.avoid)
                if spare is not None:  # restart the tree with the spare (_restart)
                    self.lost_with.add(d.avoid)
                    event = HolderMissing(
                        slot, f"input {d.key!r} is lost; spare {spare!r} is ready"
                    )
                else:
                    try:
                        holder = await self._holder_of(d.key, avoid=d.avoid)
                    except Exception as e:
                        event = HolderMissing(slot, f"{type(e).__name__}: {e}")
                    else:
                        event = HolderFound(slot, holder, self._load())
            else:
                assert isinstance(d, Spread), d
                try:
                    merged_from, adopted_from = await self.spreader.ask(self.repair.spec, d)
                except Exception as e:
                    logger.info("reduction %s: spreading node %d failed: %s", self.rid, slot, e)
                    event = SpreadFailed(slot, f"{type(e).__name__}: {e}")
                else:
                    event = SpreadAnswered(slot, merged_from, adopted_from)
            decisions = self.repair.handle(event)

    def _start_replacement(self, d: Replace, dead: str) -> dict[str, Any]:
        task = asyncio.create_task(self._start_node(d.spec, d.slot, d.offset))
        self.current[d.slot] = task
        self.joined.put_nowait(((d.slot, d.generation), task))
        logger.info(
            "reduction %s: node %d on %s died; replaced on %s from byte %d",
            self.rid,
            d.slot,
            dead,
            d.address,
            d.offset,
        )
        return {"status": "OK", "address": d.address}

    def _load(self) -> collections.Counter[str]:
        """Streams into each worker over every running tree of this tree's
        reduction (a reduce in parts runs one per segment, all rooted here)."""
        rid = self.repair.spec.reduction_rid
        roots = {self, *self.reductions.roots.values()}
        return repair_load(
            [
                r.repair
                for r in roots
                if isinstance(r, TreeRoot) and r.repair.spec.reduction_rid == rid
            ]
        )

    async def _node_failure(self, check: CheckNode) -> str | None:
        """Why node ``check.slot`` does not count as dead (None: its worker
        died). Its own call tells a dead worker (the call breaks) from a node
        that failed on its own (it answers): wait for it, briefly."""
        slot, dead = check.slot, check.dead
        task = self.current.get(slot)
        if task is not None:
            await asyncio.wait({task}, timeout=self.ctx.config.stall_timeout)
        if task is None or not task.done() or task.cancelled():
            return f"node {slot} on {dead} is not known to have died"
        e = task.exception()
        if not (isinstance(e, NodeFailed) and e.unreachable):
            return f"node {slot} on {dead} failed: {e}"
        return None

    async def _spare_instead(self, key: Key, avoid: str) -> Key | None:
        """A spare input of this tree that is ready now, if ``key`` (a dead
        node's input) has no holder but ``avoid`` (its recomputation would be
        waited for, while the spare is there; :func:`with_spares`)."""
        spec = self.repair.spec
        if not spec.spares:
            return None
        who_has = await self.ctx.worker.scheduler.who_has(keys=[*spec.inputs, *spec.spares])
        _, swaps = with_spares(spec, who_has, {avoid})
        return swaps.get(key)

    async def _holder_of(self, key: Key, avoid: str) -> str:
        """A worker holding ``key`` other than ``avoid``, waiting while the
        scheduler recomputes it."""
        who_has = await wait_for_holders(
            self.ctx.worker.scheduler,
            [key],
            lambda _, holders: bool(set(holders) - {avoid}),
            queue_timeout=self.ctx.config.queue_timeout,
            poll=0.05,
        )
        return sorted(set(who_has[key]) - {avoid})[0]


class ReduceRoots:
    """Runs the reductions whose root is on this worker."""

    def __init__(
        self, ctx: WorkerContext, reductions: RunningReductions, nodes: ReduceNodes
    ) -> None:
        self.ctx = ctx
        self.reductions = reductions
        self.nodes = nodes

    async def run(self, value: Any, spec_msg: dict[str, Any], task: Key | None = None) -> Any:
        """The result of the reduction ``spec_msg`` rooted here (``value``: the
        root's input), restarting a plain reduction whose tree broke. Where a
        spare replaced a lost input, the scheduler is told, for the result
        task ``task`` (:func:`dask_hoplite.reduced_inputs` asks it)."""
        spec = ReduceSpec.from_msg(spec_msg)
        kind = "allreduce" if spec.is_allreduce else "reduce"
        t0 = time.monotonic()
        try:
            result, restarted, swaps = await self._reduce(value, spec)
        except Exception:
            self._ended(spec.rid, len(spec.inputs), kind, "failed", t0)
            raise
        outcome = "restarted" if restarted else "ok"
        self._ended(spec.rid, len(spec.inputs), kind, outcome, t0, result.nbytes)
        if swaps and task is not None:
            await self.ctx.worker.scheduler.hoplite_spares_used(
                key=task, swaps=[[lost, spare] for lost, spare in swaps.items()]
            )
        if spec.segment is not None:  # one segment: the caller joins them
            return result
        return as_input(value, spec.inputs[spec.root], result)

    async def run_segments(self, value: Any, spec_msgs: list[dict[str, Any]]) -> Any:
        """The result of a reduce in parts rooted here: every segment's tree
        at once (the first that fails for good stops the others), the
        segments joined in place; counted and reported as one reduction."""
        specs = [ReduceSpec.from_msg(m) for m in spec_msgs]
        rid, n = specs[0].reduction_rid, len(specs[0].inputs)
        t0 = time.monotonic()
        # Each segment's root writes into its place in one result: no join.
        root_key = specs[0].inputs[specs[0].root]
        layout = layout_of(value, root_key)[0] if is_pytree(value) else None
        shape = np.shape(value) if layout is None else (layout.size,)
        dtype = getattr(value, "dtype", None) if layout is None else np.dtype(layout.dtype)
        flat: np.ndarray | None = None
        places: list[np.ndarray | None] = [None] * len(specs)
        if isinstance(dtype, np.dtype) and dtype.kind in "biufc":
            rdt = resolve_op(specs[0].op).result_dtype(dtype)
            flat = self.ctx.store.pool.allocate(math.prod(shape) * rdt.itemsize).view(rdt)
            places = [
                flat[slice(*dataclasses.replace(s, shape=shape).bounds())].view(np.uint8)
                for s in specs
            ]
        try:
            done = await all_or_cancel(
                (self._reduce(value, s, p) for s, p in zip(specs, places, strict=True)),
                "reduce segment",
            )
        except Exception:
            self._ended(rid, n, "reduce", "failed", t0)
            raise
        result = join_segments(shape, specs, [r for r, _, _ in done], out=flat)
        outcome = "restarted" if any(restarted for _, restarted, _ in done) else "ok"
        self._ended(rid, n, "reduce", outcome, t0, result.nbytes)
        return result if layout is None else unpack(layout, result)

    async def _reduce(
        self, value: Any, spec: ReduceSpec, into: np.ndarray | None = None
    ) -> tuple[Any, bool, dict[Key, Key]]:
        """The result of tree ``spec``, whether it was restarted, and the
        inputs lost with their worker that a spare replaced (lost -> spare);
        made in the bytes ``into`` if given (and they fit)."""
        ctx = self.ctx
        root = spec.root
        swaps: dict[Key, Key] = {}
        # The root's input defines the shape and dtype (and, for a pytree,
        # the structure) every input must have.
        spec = with_root_input(spec, value)
        if spec.addresses[root] != ctx.address or self.reductions.superseded(spec.rid):
            # Dask ran the result task elsewhere, or again after an earlier
            # execution of it restarted the tree: this execution is the live
            # one, and its new run supersedes whatever the earlier one left.
            spec = await self._relocated(spec, set(), swaps, supersede=True)
        # Workers that did not answer their node's call, or whose node's input
        # was lost with them.
        failed: set[str] = set()
        for attempt in range(ctx.config.max_resumes + 1):
            try:
                result = await self._attempt(spec, value, into, failed)
                break
            except (ReduceInputError, StaleRun):  # restarting would not help
                raise
            except Exception as e:
                if spec.is_allreduce or attempt == ctx.config.max_resumes:
                    raise
                if isinstance(e, NodeFailed) and e.unreachable:
                    failed.add(e.address)
                spec = await self._restart(spec, e, failed, swaps)
        if not spec.children(root):  # a single input: its buffer is the input itself
            result = result.copy()
        resolve_op(spec.op).finish(result, len(spec.inputs))
        return result, attempt > 0, swaps

    def _ended(
        self, rid: str, inputs: int, kind: str, outcome: str, t0: float, nbytes: int = 0
    ) -> None:
        """Reduction ``rid`` of ``inputs`` rooted here ended: count it, and
        report it to the scheduler's collective log (``/metrics``, the
        ``/hoplite`` page)."""
        ctx = self.ctx
        ctx.collectives[kind, outcome] += 1
        ctx.send(
            {
                "op": "hoplite-collective",
                "kind": kind,
                "outcome": outcome,
                "rid": rid,
                "root": ctx.address,
                "inputs": inputs,
                "nbytes": int(nbytes),
                "seconds": time.monotonic() - t0,
            }
        )

    async def _attempt(
        self,
        spec: ReduceSpec,
        value: Any,
        into: np.ndarray | None = None,
        lost_with: set[str] | None = None,
    ) -> Any:
        # With allreduce copies, the first one streams the root's partial result
        # while it fills: hold it until that copy has all of it (and only then
        # finish a mean in place). Registered before the node runs, so that a
        # copy finishing early is not missed.
        key = spec.partial_key(spec.root)
        async with self.reductions.held_until_sent(key, hold=bool(spec.copies)):
            root = TreeRoot(self.ctx, self.reductions, self.nodes, spec, into, lost_with)
            return await root.run(value)

    async def _restart(
        self, spec: ReduceSpec, error: Exception, avoid: set[str], swaps: dict[Key, Key]
    ) -> ReduceSpec:
        logger.warning(
            "reduction %s broke (%s: %s); restarting with the inputs located again",
            spec.rid,
            type(error).__name__,
            error,
        )
        self.ctx.event("reduce-restarts", rid=spec.rid, error=f"{type(error).__name__}: {error}")
        t0 = time.monotonic()
        new = await self._relocated(spec, avoid, swaps)
        logger.info(
            "reduction %s restarts as %s: inputs located again in %.2fs",
            spec.rid,
            new.rid,
            time.monotonic() - t0,
        )
        logger.debug("reduction %s: parents %s, workers %s", new.rid, new.parent, new.addresses)
        return new

    async def _relocated(
        self, spec: ReduceSpec, avoid: set[str], swaps: dict[Key, Key], supersede: bool = False
    ) -> ReduceSpec:
        """``spec`` as a new run rooted here, every input where it is now,
        from the scheduler's reduction coordinator: it waits while the
        scheduler recomputes lost inputs unless a spare is ready to take a
        lost input's place (recorded in ``swaps``: lost -> spare), and uses
        holders in ``avoid`` (they just failed) only if there is no other.
        A restart of a superseded run is refused (:class:`StaleRun`) but with
        ``supersede``: a result task Dask started is the live run."""
        cfg = self.ctx.config
        new, spared = await replan_tree(
            self.ctx.worker.scheduler,
            spec,
            self.ctx.address,
            avoid,
            queue_timeout=cfg.queue_timeout,
            stall_timeout=cfg.stall_timeout,
            supersede=supersede,
        )
        for lost, spare in spared.items():
            logger.warning(
                "reduction %s: input %r was lost with its worker; spare %r takes its place",
                spec.rid,
                lost,
                spare,
            )
            self.ctx.event("reduce-spares", rid=spec.rid, lost=lost, spare=spare)
            swaps[lost] = spare
        return new
