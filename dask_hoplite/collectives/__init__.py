"""Explicit collectives on Dask futures.

    import dask_hoplite as dh

    total = dh.reduce(futures, op="sum")          # Future on one worker
    total = dh.reduce(futures, op="sum", k=6)     # the first 6 of n inputs to be ready
    dh.reduced_inputs(total)                      # which inputs the result contains
    parts = dh.allreduce(futures, op="max")       # Futures, one per input, on its worker
    rows  = dh.gather(futures, to=address)        # Future of the list, on one worker
    every = dh.allgather(futures)                 # Futures of the list, one per input
    copy  = dh.broadcast(future, workers=[...])   # Futures, one per worker

Every collective returns at once, like ``client.submit``, on a synchronous
or an asynchronous client: the inputs may still be running, and the
collective is planned on the cluster when they are ready. Results are
ordinary futures (``await`` one for its value on an asynchronous client); the
collectives with several outputs return a list, like ``client.map``, in the
order of the inputs (of ``workers`` for ``broadcast``). Inputs may be
futures, or Delayed objects and Dask collections (computed first).

``reduce`` and ``allreduce`` run as :mod:`dask_hoplite.core.reduce_plan` plans
them on the cluster (pipelined reduce trees, :mod:`dask_hoplite.worker.reduce_root`;
:mod:`dask_hoplite.worker.planned_reduce`, :mod:`dask_hoplite.worker.planned_outputs`);
the others ride on hoplite's pipelined transfers of large keys. On a cluster where
dask-hoplite is not registered every call still works, the way Dask alone
would do it: a reduction is one task on the first input's worker, copies are
tasks that depend on it.

This package's ``__init__`` is the public API; the rest:

* :mod:`.split_broadcast`: the split-tree path of ``broadcast`` (``parts`` above 1);
* :mod:`.futures`: inputs as futures, kept alive while a reduction reads them.

``tests/test_module_maps.py`` checks that this list names every module here.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any

import dask
from dask import delayed
from distributed import Future

from dask_hoplite.collectives.futures import (
    INPUTS_ATTR,
    as_futures,
    client_of,
    keep_until_done,
    until_done,
)
from dask_hoplite.collectives.split_broadcast import split_broadcast
from dask_hoplite.compat import worker_addresses
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.allreduce_outputs import output_keys
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_plan import PlanRequest
from dask_hoplite.scheduler_calls import SCHEDULER_PART_KEY
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
    ``np.sum(np.stack(inputs), axis=0)``), up to the order of combination.
    Inputs may be models: dicts, lists and tuples of arrays (a ``state_dict``),
    reduced leaf by leaf in one tree and given back in their shape, each leaf
    as the type it went in (:mod:`dask_hoplite.core.pytrees`). With
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
    asynchronous client, an awaitable of them), in the order they were
    chosen. Waits for the reduction: with ``k < n``, an input lost with its
    worker while its tree ran is replaced by a spare that is ready, where
    there is one (:mod:`dask_hoplite.scheduler.spares_used`)."""
    chosen = getattr(result, INPUTS_ATTR, None)
    if chosen is None:
        raise ValueError(f"{result!r} is not the result of dask_hoplite.reduce")
    if isinstance(chosen, Future):
        return chosen.client.sync(_reduced_inputs, chosen, result)
    return list(chosen)


async def _reduced_inputs(plan: Future, result: Future) -> list[Any]:
    keys = list((await plan)["chosen"])
    client = result.client
    # Asked of the scheduler part itself, not of whether the collectives run
    # on every worker: while a worker that replaced a dead one registers its
    # part, the collectives are off, yet the swaps made before are recorded.
    if await client.scheduler.get_metadata(keys=[SCHEDULER_PART_KEY], default=None) is None:
        return keys  # Dask alone: the chosen inputs are reduced as they are
    await until_done(result)
    swaps = dict(map(tuple, await client.scheduler.hoplite_reduced_inputs(key=result.key)))
    for i, key in enumerate(keys):
        while key in swaps:  # a spare that was lost in turn, and replaced
            key = swaps.pop(key)
        keys[i] = key
    return keys


def broadcast(
    future: Any, workers: Sequence[str] | None = None, parts: int | None = None
) -> list[Future] | Awaitable[list[Future]]:
    """One copy of ``future`` on each of ``workers`` (default: all), as futures
    in the order of ``workers``, returned at once.

    On an asynchronous client it returns an awaitable of that list, as Dask's
    own calls do there (``copies = await broadcast(x)``): without
    ``workers``, it asks the scheduler for them first.

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
    if workers is not None:
        workers = list(workers)
        if not workers:
            raise ValueError("broadcast needs at least one worker; workers= is empty")
    if client.asynchronous:
        return _broadcast_when_listed(client, f, workers, parts)
    if workers is None:
        workers = worker_addresses(client)
    return _broadcast_to(client, f, workers, parts)


async def _broadcast_when_listed(
    client: Any, f: Future, workers: list[str] | None, parts: int | None
) -> list[Future]:
    """``broadcast`` on an asynchronous client: the workers are listed first."""
    if workers is None:
        workers = sorted((await client.scheduler.identity(n_workers=-1))["workers"])
    return _broadcast_to(client, f, workers, parts)


def _broadcast_to(client: Any, f: Future, workers: list[str], parts: int | None) -> list[Future]:
    """Submit the copies of ``f`` to ``workers`` (the cluster's, when empty: none)."""
    if not workers:
        raise ValueError("broadcast needs at least one worker; the cluster has none")
    if parts is not None and parts > 1 and len(workers) > 2:
        return split_broadcast(client, f, workers, parts)
    # One graph: the directory sees every receiver waiting at the first
    # request, when it decides whether to split the object into ranges.
    copies = []
    for w in workers:
        with dask.annotate(workers=[w], allow_other_workers=False):
            copies.append(delayed(tasks.broadcast_copy, pure=False)(f))
    futures: list[Future] = client.compute(copies, optimize_graph=False)
    return futures


def gather(inputs: Sequence[Any], to: str) -> Future:
    """A Future of the list of ``inputs``, on worker ``to``."""
    client = client_of(inputs)
    futures = as_futures(client, inputs)
    return client.submit(
        tasks.gathered_list, *futures, workers=[to], allow_other_workers=False, pure=False
    )


def _outputs_request(inputs: Sequence[Any], op: str, allreduce: bool) -> tuple[Any, ...]:
    """The client, the inputs as futures and the request of a collective
    with one output per input (planned on the cluster)."""
    client = client_of(inputs)
    futures = as_futures(client, inputs)
    if not futures:
        raise ValueError(f"{'allreduce' if allreduce else 'allgather'} needs at least one input")
    cfg = HopliteConfig.from_dask_config()
    req = PlanRequest(
        rid=uuid.uuid4().hex,
        op=op,
        inputs=tuple(f.key for f in futures),
        k=len(futures),
        min_bytes=cfg.min_bytes,
        block_bytes=cfg.block_bytes,
        allreduce=allreduce,
        segment_min_bytes=cfg.segment_min_bytes,
    )
    return client, futures, req


def allgather(inputs: Sequence[Any]) -> list[Future]:
    """The list of ``inputs`` on the worker of each input: one future per
    input, in input order, returned at once. Output ``i`` is made where input
    ``i`` is once all are ready (several outputs on one worker share the
    objects); Dask fetches the others' inputs, through hoplite's pipelined
    streams where it runs."""
    client, futures, req = _outputs_request(inputs, "gather", allreduce=False)
    outputs = output_keys(req)
    dsk: dict[Any, Any] = {req.plan_key: (tasks.place_allgather, req)}
    for key in outputs:
        dsk[key] = (tasks.gathered, req.plan_key, *futures)
    # the planning task stays while the outputs need it: they depend on it
    _, *results = client.get(dsk, [req.plan_key, *outputs], allow_other_workers=True, sync=False)
    return results


def allreduce(inputs: Sequence[Any], op: Any = "sum") -> list[Future]:
    """The reduction of ``inputs`` (as :func:`reduce`: arrays, or models as
    pytrees) on the worker of each input: one future per input, in input
    order, returned at once.

    Once every input is ready, the reduction is planned on the cluster
    (:mod:`dask_hoplite.worker.planned_outputs`): one reduce tree whose
    result streams down a chain of copies while it is produced, or one
    pipeline per segment; several outputs on one worker share one object.
    :func:`reduced_inputs` of any output names the inputs."""
    name = resolve_op(op).name
    client, futures, req = _outputs_request(inputs, name, allreduce=True)
    outputs = output_keys(req)
    dsk: dict[Any, Any] = {req.plan_key: (tasks.plan_allreduce, req)}
    for i, key in enumerate(outputs):
        dsk[key] = (tasks.allreduce_output, req.plan_key, i)
    plan, *results = client.get(dsk, [req.plan_key, *outputs], allow_other_workers=True, sync=False)
    for r in results:
        setattr(r, INPUTS_ATTR, plan)
    # The inputs stay while the outputs may read them (outside Dask's graph).
    keep_until_done(futures, results)
    return results
