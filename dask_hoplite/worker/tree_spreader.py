"""The root's side of spreading a dead node of a running reduce tree
(``hoplite.reduce.repair``: by default in a reduce in parts): the IO around
:mod:`dask_hoplite.core.tree_spread`.

:class:`TreeSpreader` plans a spread from what the root knows (the shapes of
every segment tree of the reduction, the workers that died), asks the worker
that recomputed the dead node's input to merge it into its own node
(``hoplite_reduce_merge``) and the adopters to take the dead node's children
(``hoplite_reduce_adopt``), all at once; each answers the byte from which it
took them on. The reply for the dead node's parent lists the patches it reads
in the dead node's place. The nodes' side is in
:mod:`dask_hoplite.worker.reduce_node` and :mod:`dask_hoplite.worker.combine`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import TreeRepair
from dask_hoplite.core.tree_spread import LiveTree, Patch, SpreadPlan, SpreadRefused
from dask_hoplite.errors import node_error
from dask_hoplite.worker.context import WorkerContext

logger = logging.getLogger(__name__)


class TreeSpreader:
    """Spreads the dead nodes of one running tree, seen from its root.

    ``live``: the tree's shape as spreads change it. ``load``: the streams
    into each worker now, over every tree of the reduction (a reduce in parts
    runs one per segment, all rooted on this worker).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        live: LiveTree,
        load: Callable[[], collections.Counter[str]],
    ) -> None:
        self.ctx = ctx
        self.live = live
        self.load = load
        #: Workers known to have died while the tree ran.
        self.dead_workers: set[str] = set()

    async def repair(
        self, repair: TreeRepair, slot: int, offset: int, holder: str
    ) -> dict[str, Any] | None:
        """The reply to the parent of dead node ``slot`` of the tree ``repair``
        keeps: the patches it reads, or a refusal if the tree must break;
        None: replace the node instead."""
        try:
            spread = await self.spread(repair.spec, slot, offset, holder)
        except Exception as e:
            repair.abandon(slot)
            logger.info("reduction %s: spreading node %d failed: %s", repair.spec.rid, slot, e)
            return {"status": "error", "message": f"{type(e).__name__}: {e}"}
        if spread is not None:
            repair.spread(slot)
            return spread
        if self.live.gone:
            # Spreads changed the children of some nodes: a node started from
            # the planned shape would read the wrong ones.
            repair.abandon(slot)
            return {"status": "error", "message": f"node {slot} could not be spread"}
        return None

    async def spread(
        self, spec: ReduceSpec, slot: int, offset: int, holder: str
    ) -> dict[str, Any] | None:
        """Spread dead node ``slot`` of ``spec``, whose parent reached byte
        ``offset``, with its input recomputed on ``holder``: the reply to the
        parent, with the patches it reads in the dead node's place; None if
        it cannot be spread. Raises if a node taking part does not answer
        (the tree then breaks)."""
        plan = self._plan(spec, slot, offset, holder)
        if plan is None:
            return None
        merged_from, adopted_from = await self._ask(spec, plan, holder)
        patches = plan.patches(merged_from, adopted_from)
        self.live.apply(plan)
        self._report(spec, plan, holder, merged_from, patches)
        hosts = spec.addresses
        return {
            "status": "OK",
            "patches": [
                {
                    "slot": slot if p.input else p.src,
                    "input": p.input,
                    "address": hosts[p.src],
                    "start": int(p.start),
                    "end": int(p.end),
                }
                for p in patches
            ],
        }

    def _plan(self, spec: ReduceSpec, slot: int, offset: int, holder: str) -> SpreadPlan | None:
        live, hosts = self.live, spec.addresses
        mine = [u for u, h in enumerate(hosts) if h == holder and u != slot and u not in live.gone]
        if not mine:
            return None  # the input's new worker runs no node of this tree
        load = self.load()
        # Only inner nodes combine streams; a leaf would hand a child back.
        inner = {u: load[hosts[u]] for u in live.inner()}
        down = {u for u, h in enumerate(hosts) if h in self.dead_workers}
        try:
            return live.plan_spread(slot, offset, mine[0], inner, down)
        except SpreadRefused as e:
            logger.info("reduction %s: not spreading node %d: %s", spec.rid, slot, e)
            return None

    async def _ask(
        self, spec: ReduceSpec, plan: SpreadPlan, holder: str
    ) -> tuple[int, dict[int, int]]:
        """Ask the nodes taking part; the byte from which the input joins, and
        each child's adopter takes it on (the node's size: never)."""
        hosts, rpc = spec.addresses, self.ctx.worker.rpc
        replies = await asyncio.gather(
            rpc(holder).hoplite_reduce_merge(
                spec=spec.to_msg(),
                slot=plan.merge_into,
                input_slot=plan.dead,
                at_least=plan.offset,
                dead=hosts[plan.dead],
            ),
            *(
                rpc(hosts[a]).hoplite_reduce_adopt(
                    rid=spec.rid, slot=a, child=c, address=hosts[c], at_least=plan.offset
                )
                for c, a in plan.adopters
            ),
        )
        asked = [plan.merge_into, *(a for _, a in plan.adopters)]
        for u, reply in zip(asked, replies, strict=True):
            error = node_error(reply, hosts[u])
            if error is not None:
                raise error
        rdt = resolve_op(spec.op).result_dtype(np.dtype(spec.dtype))
        total = math.prod(spec.node_shape()) * rdt.itemsize
        starts = [total if r["start"] is None else int(r["start"]) for r in replies]
        return starts[0], {c: e for (c, _), e in zip(plan.adopters, starts[1:], strict=True)}

    def _report(
        self,
        spec: ReduceSpec,
        plan: SpreadPlan,
        holder: str,
        merged_from: int,
        patches: list[Patch],
    ) -> None:
        self.ctx.event(
            "reduce-spread",
            rid=spec.rid,
            slot=plan.dead,
            offset=int(plan.offset),
            merged_into=plan.merge_into,
            merged_from=merged_from,
            adopters=[list(pair) for pair in plan.adopters],
            patch_bytes=[int(p.end - p.start) for p in patches],
        )
        logger.info(
            "reduction %s: node %d spread from byte %d: input into node %d on %s from %d, "
            "children to %s, %d patch(es)",
            spec.rid,
            plan.dead,
            plan.offset,
            plan.merge_into,
            holder,
            merged_from,
            dict(plan.adopters),
            len(patches),
        )
