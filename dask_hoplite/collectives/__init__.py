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

``reduce`` and ``allreduce`` run as :mod:`dask_hoplite.core.reduce_plan` plans
them (pipelined reduce trees, :mod:`dask_hoplite.worker.reduce_root`); the
others ride on hoplite's pipelined transfers of large keys. On a cluster where
dask-hoplite is not registered every call still works, the way Dask alone
would do it: a reduction is one task on the first input's worker, copies are
tasks that depend on it.

This package's ``__init__`` is the public API; the rest:

* :mod:`.allreduce_tasks`: the client side of ``allreduce`` (its plan, the tasks
  that run it), and Dask's way without the plugin;
* :mod:`.split_broadcast`: the split-tree path of ``broadcast`` (``parts`` above 1);
* :mod:`.futures`: inputs as futures, kept alive while a reduction reads them.

``tests/test_module_maps.py`` checks that this list names every module here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import dask
from dask import delayed
from distributed import Client, Future

from dask_hoplite.collectives import allreduce_tasks
from dask_hoplite.collectives.futures import (
    INPUTS_ATTR,
    as_futures,
    as_list,
    client_of,
    identity,
    keep_until_done,
)
from dask_hoplite.collectives.split_broadcast import split_broadcast
from dask_hoplite.compat import worker_addresses
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_plan import PlanRequest
from dask_hoplite.scheduler.client import hoplite_registered
from dask_hoplite.worker import tasks

logger = logging.getLogger(__name__)


def _parts_arg(collective: str, parts: Any, default: int | None) -> int | None:
    """``parts`` (``default`` if None), checked: a positive int, or None for
    "auto" (:mod:`dask_hoplite.core.shape_choice` decides on the cluster)."""
    if parts is None or parts == "auto":
        return default
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ValueError(f"{collective} parts must be a positive int or 'auto', got {parts!r}")
    return parts


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
    host takes in and sends the object once, depth about log(hosts)), each segment made in
    its place in the result on the root.
    "auto": as many as :func:`~dask_hoplite.core.shape_choice.choose_parts` predicts
    fastest for the chosen inputs' workers, size and network (decided on the cluster).
    """
    client = client_of(inputs)
    futures = as_futures(client, inputs)
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
    req = PlanRequest(
        rid=rid,
        op=name,
        inputs=keys,
        k=k,
        min_bytes=cfg.min_bytes,
        block_bytes=cfg.block_bytes,
        result=result_key,
        to=to,
        parts=parts,
    )
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
    setattr(result, INPUTS_ATTR, plan)
    # The inputs stay while the reduction may read them (outside Dask's graph).
    keep_until_done(futures, [result])
    return result


def reduced_inputs(result: Future) -> Any:
    """The keys of the inputs a :func:`reduce` result contains (with an
    asynchronous client, an awaitable of them). Waits for the choice of the
    first ``k``, not for the reduction."""
    chosen = getattr(result, INPUTS_ATTR, None)
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
    a contiguous array, pickling otherwise). "auto" (the default): no cut;
    one task per worker depends on the object, and the directory splits its
    bytes into ranges when the workers are many
    (``hoplite.broadcast.ranges``), with no copy to join them.
    """
    cfg = HopliteConfig.from_dask_config()
    parts = _parts_arg("broadcast", parts, cfg.broadcast_parts)
    client = client_of([future])
    [f] = as_futures(client, [future])
    if workers is None:
        workers = worker_addresses(client)
    if not workers:
        raise ValueError("broadcast needs at least one worker")
    if parts is not None and parts > 1 and len(workers) > 2:
        if client.sync(hoplite_registered, client):
            return split_broadcast(client, f, list(workers), parts)
    # One graph: the directory sees every receiver waiting at the first
    # request, when it decides whether to split the object into ranges.
    copies = []
    for w in workers:
        with dask.annotate(workers=[w], allow_other_workers=False):
            copies.append(delayed(identity, pure=False)(f))
    futures: list[Future] = client.compute(copies, optimize_graph=False)
    return futures


def gather(inputs: Sequence[Any], to: str) -> Future:
    """A Future of the list of ``inputs``, on worker ``to``."""
    client = client_of(inputs)
    futures = as_futures(client, inputs)
    return client.submit(as_list, *futures, workers=[to], allow_other_workers=False, pure=False)


async def _holders(client: Client, futures: list[Future]) -> list[str]:
    from distributed import wait

    await wait(futures)
    who_has = await client.scheduler.who_has(  # type: ignore[union-attr]
        keys=[f.key for f in futures]
    )
    return sorted({w for f in futures for w in who_has.get(f.key) or ()})


async def _allgather_async(client: Client, futures: list[Future]) -> list[Future]:
    return [
        client.submit(as_list, *futures, workers=[w], allow_other_workers=False, pure=False)
        for w in await _holders(client, futures)
    ]


def allgather(inputs: Sequence[Any]) -> list[Future]:
    """The list of ``inputs`` on every worker that holds one of them."""
    client = client_of(inputs)
    return client.sync(_allgather_async, client, as_futures(client, inputs))


def allreduce(inputs: Sequence[Any], op: Any = "sum") -> list[Future]:
    """The reduction of ``inputs``, on every worker that holds one of them:
    the root's result first, then one copy per other worker. The copies stream
    the result through a chain while the reduce tree is still producing it."""
    client = client_of(inputs)
    return client.sync(allreduce_tasks.plan_and_submit, client, as_futures(client, inputs), op)
