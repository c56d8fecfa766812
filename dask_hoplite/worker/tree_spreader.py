"""The root's side of spreading a dead node of a running reduce tree
(``hoplite.reduce.repair``: by default in a reduce in parts): the IO of the
spreads that :class:`~dask_hoplite.core.tree_repair.TreeRepair` decides
(planned by :mod:`dask_hoplite.core.tree_spread`).

:class:`TreeSpreader` asks the worker that recomputed the dead node's input
to merge it into its own node (``hoplite_reduce_merge``) and the adopters to
take the dead node's children (``hoplite_reduce_adopt``), all at once; each
answers the byte from which it took them on. The reply for the dead node's
parent lists the patches it reads in the dead node's place. The nodes' side
is in :mod:`dask_hoplite.worker.reduce_node` and
:mod:`dask_hoplite.worker.combine`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

import numpy as np

from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import Patches, Spread
from dask_hoplite.errors import node_error
from dask_hoplite.worker.context import WorkerContext

logger = logging.getLogger(__name__)


class TreeSpreader:
    """Carries out the spreads of one running tree's dead nodes that its
    root's :class:`~dask_hoplite.core.tree_repair.TreeRepair` decides."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    async def ask(self, spec: ReduceSpec, spread: Spread) -> tuple[int, dict[int, int]]:
        """Ask the nodes taking part in ``spread`` (all at once); the byte
        from which the input joins, and the byte from which each child's
        adopter takes it on (the node's size: never). Raises if a node does
        not answer or refuses."""
        plan, holder = spread.plan, spread.holder
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

    def reply(self, spec: ReduceSpec, done: Patches) -> dict[str, Any]:
        """The reply to the dead node's parent: the patches it reads in the
        node's place; the spread is reported (event, log)."""
        self._report(spec, done)
        hosts = spec.addresses
        return {
            "status": "OK",
            "patches": [
                {
                    "slot": done.slot if p.input else p.src,
                    "input": p.input,
                    "address": hosts[p.src],
                    "start": int(p.start),
                    "end": int(p.end),
                }
                for p in done.patches
            ],
        }

    def _report(self, spec: ReduceSpec, done: Patches) -> None:
        plan = done.plan
        self.ctx.event(
            "reduce-spread",
            rid=spec.rid,
            slot=plan.dead,
            offset=int(plan.offset),
            merged_into=plan.merge_into,
            merged_from=done.merged_from,
            adopters=[list(pair) for pair in plan.adopters],
            patch_bytes=[int(p.end - p.start) for p in done.patches],
        )
        logger.info(
            "reduction %s: node %d spread from byte %d: input into node %d on %s from %d, "
            "children to %s, %d patch(es)",
            spec.rid,
            plan.dead,
            plan.offset,
            plan.merge_into,
            done.holder,
            done.merged_from,
            dict(plan.adopters),
            len(done.patches),
        )
