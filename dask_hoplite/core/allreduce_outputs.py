"""An allreduce's outputs: one per input, in input order. Pure: no I/O.

:func:`dask_hoplite.allreduce` returns one future per input, at once, so a
caller can zip inputs with results; output ``i`` is made on the worker that
holds input ``i`` when the plan is made (the plan's worker for that input).
A plan (:mod:`dask_hoplite.core.reduce_plan`) has one part per worker (the
root, a copy, a segment's part); :func:`output_roles` gives that part to
the first output on each worker and makes every other output on the same
worker an alias, which takes the value of that worker's first output once
it is in memory there (no bytes cross the network for it).

A role travels as a msgpack-able list: ``["root"]``, ``["copy", j]``,
``["part", i]``, ``["reduce"]`` (one task reduces every input),
``["pull", p]`` (the value of output ``p``, made on another worker, asked
for before it exists) and ``["alias", p]`` (output ``p`` of this worker).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dask.typing import Key

from dask_hoplite.core.reduce_plan import (
    AllreduceTree,
    OneTask,
    Plan,
    PlanRequest,
    SegmentedAllreduce,
    Tree,
    input_worker,
)


def output_keys(req: PlanRequest) -> list[str]:
    """The keys of the outputs of request ``req``, one per input:
    ``hoplite-allreduce-<op>-<rid>-<i>`` for an allreduce, else
    ``hoplite-all<op>-<rid>-<i>`` (an allgather asks with op ``gather``)."""
    name = f"allreduce-{req.op}" if req.allreduce else f"all{req.op}"
    return [f"hoplite-{name}-{req.rid}-{i}" for i in range(len(req.inputs))]


def output_workers(inputs: Sequence[Key], who_has: Mapping[Key, Sequence[str]]) -> list[str]:
    """The worker each output is made on: where the planner takes its input
    from (:func:`~dask_hoplite.core.reduce_plan.input_worker`)."""
    return [input_worker(key, who_has, None) for key in inputs]


def output_roles(plan: Plan, workers: Sequence[str]) -> list[list[Any]]:
    """The role of each output, made on ``workers[i]`` (see the module's
    docstring). Every worker of the plan is the worker of some output."""
    first: dict[str, int] = {}
    for i, w in enumerate(workers):
        first.setdefault(w, i)
    roles: list[list[Any]] = []
    for i, w in enumerate(workers):
        if first[w] != i:
            roles.append(["alias", first[w]])
        else:
            roles.append(_part_of(plan, w, first))
    return roles


def _part_of(plan: Plan, w: str, first: Mapping[str, int]) -> list[Any]:
    """The part of ``plan`` that worker ``w`` runs."""
    if isinstance(plan, OneTask):
        if w == plan.worker:
            return ["reduce"]
        return ["pull", first[plan.worker]]
    if isinstance(plan, Tree):
        return ["root"]
    if isinstance(plan, AllreduceTree):
        if w == plan.root:
            return ["root"]
        return ["copy", plan.spec.copies.index(w)]
    if isinstance(plan, SegmentedAllreduce):
        return ["part", plan.workers.index(w)]
    raise TypeError(f"an allreduce does not run a {type(plan).__name__}")
