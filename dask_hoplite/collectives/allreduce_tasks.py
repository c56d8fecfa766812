"""The client side of :func:`dask_hoplite.allreduce`: once the inputs are
ready, where they are, the plan (:func:`~dask_hoplite.core.reduce_plan.plan_reduction`)
and the tasks that carry it out, submitted by the plan's type; and Dask's own
way where dask-hoplite is not registered (one task reduces, the copies are
tasks that depend on it)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from distributed import Client, Future, as_completed

from dask_hoplite.collectives.futures import INPUTS_ATTR, identity, keep_until_done
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_plan import (
    AllreduceTree,
    OneTask,
    PlanRequest,
    SegmentedAllreduce,
    Tree,
    plan_reduction,
)
from dask_hoplite.core.reduce_spec import reduce_values
from dask_hoplite.errors import ReduceInputLost
from dask_hoplite.scheduler.client import hoplite_registered
from dask_hoplite.worker import tasks


async def plan_and_submit(client: Client, futures: list[Future], op: Any) -> list[Future]:
    """Plan and submit an allreduce once its inputs are ready: the result
    followed by one copy per other worker holding an input, streamed while
    the reduction runs."""
    rop = resolve_op(op)
    if not futures:
        raise ValueError("reduce needs at least one input")
    chosen = await _in_order_ready(futures)
    keys = [f.key for f in chosen]
    who_has, nbytes, net = await _locate(client, keys)
    cfg = HopliteConfig.from_dask_config()
    req = PlanRequest(
        rid=uuid.uuid4().hex,
        op=rop.name,
        inputs=tuple(keys),
        k=len(keys),
        min_bytes=cfg.min_bytes,
        block_bytes=cfg.block_bytes,
        allreduce=True,
        segment_min_bytes=cfg.segment_min_bytes,
    )
    plan = plan_reduction(req, keys, who_has, nbytes, net)
    if isinstance(plan, OneTask) and not plan.registered:
        # dask-hoplite is not registered: Dask's way, one task on the first
        # input's worker and a copy of its result on every other worker.
        result = _reduce_small(client, chosen, plan)
        return [result, *_copies(client, result, plan.copies)]
    if isinstance(plan, OneTask):
        return _allreduce_small(client, chosen, plan)
    if isinstance(plan, SegmentedAllreduce):
        return _allreduce_segmented(client, chosen, plan)
    assert isinstance(plan, (AllreduceTree, Tree)), plan
    return _allreduce_tree(client, chosen, plan)


async def _in_order_ready(futures: list[Future]) -> list[Future]:
    """``futures`` in the order they become ready (an input that failed is
    reported as soon as it does)."""
    ready: list[Future] = []
    async for f in as_completed(futures):
        if f.status == "error":
            raise ReduceInputLost(f"input {f.key!r} of the reduction failed") from (
                await f.exception()
            )
        ready.append(f)
    return ready


def _allreduce_tree(
    client: Client, chosen: list[Future], plan: AllreduceTree | Tree
) -> list[Future]:
    """Submit one reduce tree over ``chosen``: the root's task, then one
    allreduce copy per other worker (none for a :class:`Tree`: every input
    is on the root's worker)."""
    spec = plan.spec
    future_of = {f.key: f for f in chosen}
    msg = plan.to_msg()
    result = client.submit(
        tasks.allreduce_root if isinstance(plan, AllreduceTree) else tasks.tree_root,
        future_of[spec.inputs[spec.root]],
        msg,
        key=f"hoplite-reduce-{plan.op}-{spec.rid}",
        workers=[plan.root],
        # the root survives the death of its worker: Dask runs it elsewhere
        # and it locates the inputs again (an allreduce root reduces anew)
        allow_other_workers=True,
        pure=False,
    )
    setattr(result, INPUTS_ATTR, list(spec.inputs))
    # Keep the inputs alive until the reduction is done (only the root's input
    # is a Dask dependency of the result; the others stream from their holders).
    keep_until_done(chosen, [result])
    return [result] + [
        client.submit(
            tasks.allreduce_copy,
            msg,
            j,
            key=f"hoplite-allreduce-{plan.op}-{spec.rid}-{j}",
            workers=[addr],
            allow_other_workers=True,  # a dead worker's copy is made elsewhere
            pure=False,
        )
        for j, addr in enumerate(spec.copies)
    ]


async def _locate(
    client: Client, keys: list[Any]
) -> tuple[dict[Any, list[str]], dict[Any, int], NetworkEstimate | None]:
    """Where ``keys`` are, their sizes and the network estimate, in one round
    trip to the scheduler part; the estimate is None when dask-hoplite is not
    registered on the cluster (then where and how big, asked of Dask)."""
    if await hoplite_registered(client):
        m = await client.scheduler.hoplite_locate(keys=keys)  # type: ignore[union-attr]
        return m["who_has"], m["nbytes"], NetworkEstimate.from_msg(m["network"])
    who_has, nbytes = await asyncio.gather(
        client.scheduler.who_has(keys=keys),  # type: ignore[union-attr]
        client.scheduler.nbytes(keys=keys, summary=False),  # type: ignore[union-attr]
    )
    return who_has, nbytes, None


def _allreduce_segmented(
    client: Client, chosen: list[Future], plan: SegmentedAllreduce
) -> list[Future]:
    """Submit an allreduce in segments: one task per segment's root worker,
    which reduces its segment and joins the others' copies."""
    msg = plan.to_msg()
    parts = [
        client.submit(
            tasks.allreduce_part,
            chosen[slot],
            msg,
            i,
            key=f"hoplite-allreduce-{plan.op}-{plan.rid}-{i}",
            workers=[wi],
            allow_other_workers=True,  # a dead worker's part is made elsewhere
            pure=False,
        )
        for i, (slot, wi) in enumerate(zip(plan.roots, plan.workers, strict=True))
    ]
    keep_until_done(chosen, parts)
    setattr(parts[0], INPUTS_ATTR, list(plan.chosen))
    return parts


def _reduce_small_task(op: str, keys: list[Any], *arrays: Any) -> np.ndarray:
    return reduce_values(op, keys, list(arrays))


def _reduce_small(client: Client, chosen: list[Future], plan: OneTask) -> Future:
    keys = list(plan.chosen)
    result = client.submit(
        _reduce_small_task, plan.op, keys, *chosen, workers=[plan.worker], pure=False
    )
    setattr(result, INPUTS_ATTR, keys)
    return result


def _copies(client: Client, result: Future, workers: Sequence[str]) -> list[Future]:
    """One copy of ``result`` on every worker of ``workers``, as Dask makes
    copies: tasks that depend on it."""
    return [
        client.submit(identity, result, workers=[w], allow_other_workers=True, pure=False)
        for w in workers
    ]


def _allreduce_small(client: Client, chosen: list[Future], plan: OneTask) -> list[Future]:
    """Allreduce of small objects: one task reduces on the first input's
    worker, as Dask would; the copies, one task per other worker, start at
    the same time and ask that worker for the result (``hoplite_result``),
    which answers the moment the result exists.

    Copies that depend on the result in Dask's graph would wait for the
    scheduler to learn of the result, send them, and fetch it: one task layer
    more than the reduction plus its consumers. Every worker reducing all
    inputs itself would take one layer but (N-1)^2 transfers, and on a
    loaded host each transfer costs more than the layer saved (measured).
    A copy whose root is gone reduces the inputs itself."""
    keys = list(plan.chosen)
    result = client.submit(
        _reduce_small_task,
        plan.op,
        keys,
        *chosen,
        key=f"hoplite-allreduce-{plan.op}-{plan.rid}",
        workers=[plan.worker],
        allow_other_workers=True,  # survives its worker; the copies follow it
        pure=False,
    )
    copies = []
    for j, w in enumerate(plan.copies):
        key = f"hoplite-allreduce-{plan.op}-{plan.rid}-{j}"
        req = {"result": result.key, "root": plan.worker, "op": plan.op, "inputs": keys, "key": key}
        copies.append(
            client.submit(
                tasks.small_copy,
                req,
                key=key,
                workers=[w],
                allow_other_workers=True,  # a dead worker's copy is made elsewhere
                pure=False,
            )
        )
    # The result and the inputs stay while a copy may still want them.
    keep_until_done([result, *chosen], copies)
    setattr(result, INPUTS_ATTR, keys)
    return [result, *copies]
