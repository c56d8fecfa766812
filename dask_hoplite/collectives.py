"""Explicit collectives on Dask futures.

    import dask_hoplite as dh

    total = dh.reduce(futures, op="sum")          # Future on one worker
    total = dh.reduce(futures, op="sum", k=6)     # the first 6 of n inputs to be ready
    dh.reduced_inputs(total)                      # which inputs the result contains
    parts = dh.allreduce(futures, op="max")       # Futures, one per input's worker
    rows  = dh.gather(futures, to=address)        # Future of the list, on one worker
    every = dh.allgather(futures)                 # Futures of the list, one per worker
    copy  = dh.broadcast(future, workers=[...])   # Futures, one per worker

Results are ordinary futures. Inputs may be futures, or Delayed objects and
Dask collections (computed first). With an asynchronous client, ``await`` them.

``reduce`` runs a pipelined reduce tree (:mod:`dask_hoplite.worker.reduce_root`)
shaped by :mod:`dask_hoplite.core.planner`; the others ride on hoplite's
pipelined transfers of large keys. On a cluster where dask-hoplite is not
registered every call still works, the way Dask alone would do it: a reduction
is one task on the first input's worker, copies are tasks that depend on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from dask.base import is_dask_collection
from distributed import Client, Future, as_completed, default_client

from dask_hoplite.compat import worker_addresses
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.planner import max_chain_length, plan_reduce_tree
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_plan import PlanRequest, tree_spec
from dask_hoplite.core.reduce_spec import ReduceSpec, reduce_values, segment_rid
from dask_hoplite.scheduler_queries import hoplite_registered
from dask_hoplite.split_broadcast import split_broadcast
from dask_hoplite.worker import tasks

logger = logging.getLogger(__name__)

_INPUTS_ATTR = "_hoplite_reduced_inputs"


def _client(inputs: Sequence[Any]) -> Client:
    for f in inputs:
        if isinstance(f, Future):
            return f.client
    return default_client()


def _as_futures(client: Client, inputs: Sequence[Any]) -> list[Future]:
    out: list[Future] = []
    todo = []
    for i, x in enumerate(inputs):
        if isinstance(x, Future):
            out.append(x)
        elif is_dask_collection(x):
            out.append(None)  # type: ignore[arg-type]
            todo.append((i, x))
        else:
            raise TypeError(
                f"input {i} is a {type(x).__name__}; collectives take Dask futures, "
                "Delayed objects or Dask collections"
            )
    if todo:
        computed = client.compute([x for _, x in todo])
        for (i, _), f in zip(todo, computed, strict=True):
            out[i] = f
    return out


def _parts_arg(collective: str, parts: Any, default: int) -> int:
    """``parts`` (``default`` if None), checked: a positive int."""
    parts = default if parts is None else parts
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"{collective} parts must be a positive int, got {parts!r}")
    return parts


def _identity(x: Any) -> Any:
    return x


def _as_list(*xs: Any) -> list[Any]:
    return list(xs)


async def _allreduce_async(client: Client, futures: list[Future], op: Any) -> list[Future]:
    """Plan and submit an allreduce once its inputs are ready: the result
    followed by one copy per other worker holding an input, streamed while
    the reduction runs."""
    rop = resolve_op(op)
    if not futures:
        raise ValueError("reduce needs at least one input")
    chosen = await _in_order_ready(futures)
    keys = [f.key for f in chosen]
    who_has, nbytes, net = await _locate(client, keys)
    addresses = []
    for key in keys:
        holders = who_has.get(key) or []
        if not holders:
            raise RuntimeError(f"input {key!r} of the reduction is not in memory anywhere")
        addresses.append(sorted(holders)[0])
    size = max(int(nbytes.get(key, 0) or 0) for key in keys)
    cfg = HopliteConfig.from_dask_config()
    if net is None:
        # dask-hoplite is not registered: Dask's way, one task on the first
        # input's worker and a copy of its result on every other worker.
        result = _reduce_small(client, chosen, keys, rop.name, addresses)
        return result + _copies(client, result[0], addresses)
    if size < cfg.min_bytes:
        # Small objects: a tree costs more round trips than it saves bytes;
        # one task on the first input's worker, as Dask would do it.
        return _allreduce_small(client, chosen, keys, rop.name, addresses)
    distinct = list(dict.fromkeys(addresses))
    if len(distinct) >= 3 and size // len(distinct) >= cfg.segment_min_bytes:
        return _allreduce_segmented(client, chosen, addresses, distinct, rop.name, net, size, cfg)
    return _reduce_tree(client, chosen, addresses, rop.name, net, size, cfg)


async def _in_order_ready(futures: list[Future]) -> list[Future]:
    """``futures`` in the order they become ready (an input that failed is
    reported as soon as it does)."""
    ready: list[Future] = []
    async for f in as_completed(futures):
        if f.status == "error":
            raise RuntimeError(f"input {f.key!r} of the reduction failed") from (
                await f.exception()
            )
        ready.append(f)
    return ready


def _reduce_tree(
    client: Client,
    chosen: list[Future],
    addresses: list[str],
    op: str,
    net: NetworkEstimate,
    size: int,
    cfg: HopliteConfig,
) -> list[Future]:
    """Submit one reduce tree over ``chosen`` (held by ``addresses``): the
    root's task, then one allreduce copy per other worker."""
    keys = [f.key for f in chosen]
    spec = tree_spec(uuid.uuid4().hex, op, keys, addresses, net, size, cfg.block_bytes)
    root = spec.root
    root_address = spec.addresses[root]
    spec = dataclasses.replace(spec, copies=tuple(sorted(set(spec.addresses) - {root_address})))
    future_of = dict(zip(keys, chosen, strict=True))
    result = client.submit(
        tasks.reduce_root,
        future_of[spec.inputs[root]],
        spec.to_msg(),
        key=f"hoplite-reduce-{op}-{spec.rid}",
        workers=[root_address],
        # the root survives the death of its worker: Dask runs it elsewhere
        # and it locates the inputs again (an allreduce root reduces anew)
        allow_other_workers=True,
        pure=False,
    )
    setattr(result, _INPUTS_ATTR, list(spec.inputs))
    # Keep the inputs alive until the reduction is done (only the root's input
    # is a Dask dependency of the result; the others stream from their holders).
    _keep_until_done(chosen, [result])
    return [result] + [
        client.submit(
            tasks.allreduce_copy,
            spec.to_msg(),
            j,
            key=f"hoplite-allreduce-{op}-{spec.rid}-{j}",
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


def _keep_until_done(keep: list[Future], futures: list[Future]) -> None:
    """Hold the futures ``keep`` (so Dask keeps their keys) until every one
    of ``futures`` is done: those tasks read them outside Dask's graph."""
    if not futures:
        return
    held = list(keep)
    remaining = set(range(len(futures)))

    def done(j: int) -> None:
        remaining.discard(j)
        if not remaining:
            held.clear()

    for j, f in enumerate(futures):
        f.add_done_callback(lambda _, j=j: done(j))


def _allreduce_segmented(
    client: Client,
    chosen: list[Future],
    addresses: list[str],
    distinct: list[str],
    op: str,
    net: NetworkEstimate,
    size: int,
    cfg: HopliteConfig,
) -> list[Future]:
    """Allreduce as m concurrent reduce-then-broadcast pipelines, one per
    segment of 1/m of the object, each rooted on another of the m workers.

    Segment i's reduce chain runs through the workers in the order i+1, i+2,
    ..., i (its root) and its result streams to i+1, i+2, ... as it fills, so
    every worker sends and receives (m-1)/m of the object in each phase:
    2(m-1)/m * S per NIC and direction, the bound, where one tree plus one
    chain of copies would make every worker carry 2 S.
    """
    n, m = len(chosen), len(distinct)
    rid = uuid.uuid4().hex
    plan = plan_reduce_tree(n, max_chain_length(size // m, net.bandwidth, net.latency))
    positions = [p for p in range(n) if p != plan.root]  # filled in order
    specs = []
    roots = []
    for i, wi in enumerate(distinct):
        rotation = distinct[i + 1 :] + distinct[: i + 1]  # wi last
        rank = {w: r for r, w in enumerate(rotation)}
        root_slot = addresses.index(wi)
        others = sorted(
            (s for s in range(n) if s != root_slot), key=lambda s: (rank[addresses[s]], s)
        )
        slot_at = {plan.root: root_slot, **dict(zip(positions, others, strict=True))}
        parent: list[int | None] = [None] * n
        for p in range(n):
            q = plan.parent[p]
            parent[slot_at[p]] = None if q is None else slot_at[q]
        specs.append(
            ReduceSpec(
                rid=segment_rid(rid, i),
                op=op,
                inputs=tuple(f.key for f in chosen),
                addresses=tuple(addresses),
                parent=tuple(parent),
                shape=(),
                dtype="",
                block_bytes=cfg.block_bytes,
                copies=tuple(rotation[:-1]),
                segment=(i, m),
            ).to_msg()
        )
        roots.append(root_slot)
    parts = [
        client.submit(
            tasks.allreduce_part,
            chosen[roots[i]],
            specs,
            i,
            key=f"hoplite-allreduce-{op}-{rid}-{i}",
            workers=[wi],
            allow_other_workers=True,  # a dead worker's part is made elsewhere
            pure=False,
        )
        for i, wi in enumerate(distinct)
    ]
    _keep_until_done(chosen, parts)
    setattr(parts[0], _INPUTS_ATTR, [f.key for f in chosen])
    return parts


def _reduce_small_task(op: str, keys: list[Any], *arrays: Any) -> np.ndarray:
    return reduce_values(op, keys, list(arrays))


def _reduce_small(
    client: Client,
    chosen: list[Future],
    keys: list[Any],
    op: str,
    addresses: list[str],
) -> list[Future]:
    result = client.submit(
        _reduce_small_task, op, keys, *chosen, workers=[addresses[0]], pure=False
    )
    setattr(result, _INPUTS_ATTR, keys)
    return [result]


def _copies(client: Client, result: Future, addresses: list[str]) -> list[Future]:
    """One copy of ``result`` on every worker of ``addresses`` but the first,
    as Dask makes copies: tasks that depend on it."""
    return [
        client.submit(_identity, result, workers=[w], allow_other_workers=True, pure=False)
        for w in sorted(set(addresses) - {addresses[0]})
    ]


def _allreduce_small(
    client: Client, chosen: list[Future], keys: list[Any], op: str, addresses: list[str]
) -> list[Future]:
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
    rid = uuid.uuid4().hex
    result = client.submit(
        _reduce_small_task,
        op,
        keys,
        *chosen,
        key=f"hoplite-allreduce-{op}-{rid}",
        workers=[addresses[0]],
        allow_other_workers=True,  # survives its worker; the copies follow it
        pure=False,
    )
    copies = []
    for j, w in enumerate(sorted(set(addresses) - {addresses[0]})):
        key = f"hoplite-allreduce-{op}-{rid}-{j}"
        req = {"result": result.key, "root": addresses[0], "op": op, "inputs": keys, "key": key}
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
    _keep_until_done([result, *chosen], copies)
    setattr(result, _INPUTS_ATTR, keys)
    return [result, *copies]


def reduce(
    inputs: Sequence[Any],
    op: Any = "sum",
    k: int | None = None,
    to: str | None = None,
    parts: int | None = None,
) -> Future:
    """Reduce ``inputs`` (numpy arrays of one shape and dtype) with ``op``.

    ``op`` is 'sum', 'prod', 'min', 'max', 'mean' or any binary numpy ufunc; the
    result equals numpy's reduction over a stack of the inputs (e.g.
    ``np.sum(np.stack(inputs), axis=0)``), up to the order of combination. With
    ``k``, only the first ``k`` inputs to be ready are reduced; see
    :func:`reduced_inputs`. Returns a Future of the result, on one worker, at
    once, like ``client.submit``: the inputs may still be pending, and the
    first ``k`` are chosen on the cluster as they finish
    (:mod:`dask_hoplite.worker.planned_reduce`).

    ``to``: the address of the worker the result must be on (e.g. a parameter
    server's); the tree is rooted there, with an input that worker holds when
    one is chosen. If that worker dies, the result is made elsewhere.

    ``parts`` (default ``hoplite.reduce.parts``): above 1, each of that many segments of
    the inputs is reduced up its own tree (the split-tree broadcast's trees, upwards: each
    host takes in and sends the object once, depth about log(hosts)); the root joins them.
    """
    client = _client(inputs)
    futures = _as_futures(client, inputs)
    name = resolve_op(op).name
    n = len(futures)
    if n == 0:
        raise ValueError("reduce needs at least one input")
    k = n if k is None else k
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, {n}] (the number of inputs), got {k!r}")
    cfg = HopliteConfig.from_dask_config()
    parts = _parts_arg("reduce", parts, cfg.reduce_parts)
    rid = uuid.uuid4().hex
    result_key = f"hoplite-reduce-{name}-{rid}"
    if to is not None and not isinstance(to, str):
        raise TypeError(f"to must be a worker address (str), got {type(to).__name__}")
    keys = tuple(f.key for f in futures)
    req = PlanRequest(rid, name, keys, k, result_key, cfg.min_bytes, cfg.block_bytes, to, parts)
    plan_key = req.plan_key
    # One graph: the planning task (no dependencies: it waits on the cluster
    # for the first k inputs) and the result task, which runs where the plan
    # restricts it, or anywhere if that worker is gone (loose restrictions).
    plan, result = client.get(
        {plan_key: (tasks.plan_reduce, req), result_key: (tasks.run_reduce, plan_key)},
        [plan_key, result_key],
        allow_other_workers=True,
        sync=False,
    )
    setattr(result, _INPUTS_ATTR, plan)
    # The inputs stay while the reduction may read them (outside Dask's graph).
    _keep_until_done(futures, [result])
    return result


def reduced_inputs(result: Future) -> Any:
    """The keys of the inputs a :func:`reduce` result contains (with an
    asynchronous client, an awaitable of them). Waits for the choice of the
    first ``k``, not for the reduction."""
    chosen = getattr(result, _INPUTS_ATTR, None)
    if chosen is None:
        raise ValueError(f"{result!r} is not the result of dask_hoplite.reduce")
    if isinstance(chosen, Future):
        return chosen.client.sync(_reduced_inputs, chosen)
    return list(chosen)


async def _reduced_inputs(plan: Future) -> list[Any]:
    return list((await plan)["chosen"])


def broadcast(
    future: Any, workers: Sequence[str] | None = None, parts: int | None = None
) -> list[Future]:
    """One copy of ``future`` on each of ``workers`` (default: all), as futures.

    ``parts`` (default ``hoplite.broadcast.parts``): above 1, the object is
    cut into that many parts, each broadcast down its own tree
    (:mod:`dask_hoplite.core.split_trees`), and each worker joins them. The
    depth grows as log(workers) instead of one hop per worker, for a copy of
    the object on each receiver (joining) and a cut on the holder (a view for
    a contiguous array, pickling otherwise).
    """
    parts = _parts_arg("broadcast", parts, HopliteConfig.from_dask_config().broadcast_parts)
    client = _client([future])
    [f] = _as_futures(client, [future])
    if workers is None:
        workers = worker_addresses(client)
    if not workers:
        raise ValueError("broadcast needs at least one worker")
    if parts > 1 and len(workers) > 2 and client.sync(hoplite_registered, client):
        return split_broadcast(client, f, list(workers), parts)
    return [
        client.submit(_identity, f, workers=[w], allow_other_workers=False, pure=False)
        for w in workers
    ]


def gather(inputs: Sequence[Any], to: str) -> Future:
    """A Future of the list of ``inputs``, on worker ``to``."""
    client = _client(inputs)
    futures = _as_futures(client, inputs)
    return client.submit(_as_list, *futures, workers=[to], allow_other_workers=False, pure=False)


async def _holders(client: Client, futures: list[Future]) -> list[str]:
    from distributed import wait

    await wait(futures)
    who_has = await client.scheduler.who_has(  # type: ignore[union-attr]
        keys=[f.key for f in futures]
    )
    return sorted({w for f in futures for w in who_has.get(f.key) or ()})


async def _allgather_async(client: Client, futures: list[Future]) -> list[Future]:
    return [
        client.submit(_as_list, *futures, workers=[w], allow_other_workers=False, pure=False)
        for w in await _holders(client, futures)
    ]


def allgather(inputs: Sequence[Any]) -> list[Future]:
    """The list of ``inputs`` on every worker that holds one of them."""
    client = _client(inputs)
    return client.sync(_allgather_async, client, _as_futures(client, inputs))


def allreduce(inputs: Sequence[Any], op: Any = "sum") -> list[Future]:
    """The reduction of ``inputs``, on every worker that holds one of them:
    the root's result first, then one copy per other worker. The copies stream
    the result through a chain while the reduce tree is still producing it."""
    client = _client(inputs)
    return client.sync(_allreduce_async, client, _as_futures(client, inputs), op)
