"""dask.array and dask.bag reductions, recognised in the task graph, as
pipelined reduce trees.

``x.sum(axis=0).compute()`` is left as the user wrote it. Dask builds such a
reduction (``dask.array.reductions._tree_reduce``) as a per-chunk step whose
outputs keep the reduced axes with extent 1, then a tree of *aggregate* tasks
(``split_every`` inputs each, 4 by default), every one of them
``F(_concatenate2(parts, axes))`` with ``F`` one of numpy's sum, prod, min, max
(or ``mean_combine`` / ``mean_agg`` on ``{"n", "total"}`` dicts). Each edge of
that tree is a whole-object fetch and each level waits for the one below.

Why this integration point (the scheduler's graph, see
:class:`dask_hoplite.graph_reductions.scheduler_hook.GraphRewrite`):

* Annotations and task names do not survive low-level fusion; the *functions* of
  the aggregate tasks do, and the scheduler sees the graph after all client- and
  scheduler-side optimisation, whatever collection API built it.
* On the scheduler the plugin's registration is the switch: a user's client code
  needs no import and no configuration, and a cluster without the plugin runs
  the graph exactly as Dask built it.
* The rewritten task is a plain Dask task that depends on all the parts, so
  Dask's own bookkeeping keeps every part alive until the reduction is done and
  recomputes lost parts from lineage. Its function, :class:`GraphReduce`, is
  correct on its own (a worker without the plugin just runs it); the worker
  part recognises it when the task arrives and, when the parts are large,
  reduces them where they live with a pipelined tree instead of fetching them
  (:class:`dask_hoplite.graph_reductions.worker_takeover.AggregateTakeover`).

Rewrite rules (:func:`rewrite_graph`, pure: a dict of tasks in, a dict out):

1. A task whose function is a recognised aggregate of the shape above becomes
   ``Task(key, GraphReduce(...), *parts)``.
2. Along a single reduced axis, an aggregate whose parts are themselves
   aggregates of the same operator (not requested by the client, no other
   dependent) absorbs them: the whole ``split_every`` tree becomes one
   reduction over the per-chunk parts, up to ``max_inputs`` parts. Sound because
   the operators are associative and every part has extent 1 along the axis.

dask.bag (``Bag.fold`` / ``Bag.reduction`` / ``Bag.sum``) builds the same shape:
per-partition tasks, then a ``split_every`` tree (8 by default) of
``empty_safe_aggregate(aggregate, parts, is_last)`` tasks. An aggregate is
recognised when it folds its parts with a binary operator that is elementwise,
associative and commutative on numpy arrays (:data:`~dask_hoplite.graph_reductions.recognize.BAG_BINOPS`: ``operator.add``,
``np.add``, ``np.maximum``, ...), written as ``fold(binop)`` /
``fold(binop, combine)`` builds it, or is the builtin ``sum`` of ``Bag.sum()``.
The partial results become inputs of a reduce tree when they turn out to be
numpy arrays of one shape and dtype, at least ``min-bytes``; anything else (a
bag of Python numbers, lists, empty partitions) runs Dask's own aggregate on
fetched parts, with the same result as without the plugin.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask._task_spec import DataNode, Task, TaskRef
from dask.typing import Key

from dask_hoplite.graph_reductions.recognize import Aggregate, recognize

try:
    from dask._task_spec import _execute_subgraph
except ImportError:  # a release without it: the graph reductions turn off (compat), not this import
    _execute_subgraph = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def _depth(template: Any) -> int:
    depth = 0
    while isinstance(template, list) and template:
        depth += 1
        template = template[0]
    return depth


def _flat(structure: Any) -> list[Key]:
    if isinstance(structure, list):
        return [k for s in structure for k in _flat(s)]
    return [structure]


def _indexed(structure: Any, index: dict[Key, int]) -> Any:
    if isinstance(structure, list):
        return [_indexed(s, index) for s in structure]
    return index[structure]


def _nest(template: Any, values: Sequence[Any]) -> Any:
    if isinstance(template, list):
        return [_nest(t, values) for t in template]
    return values[template]


class GraphReduce:
    """The function of a rewritten aggregate task: ``final(nested parts)``.

    Called with the parts (as Dask would, after fetching them), it computes
    exactly what the aggregate(s) it replaces computed. The worker part calls
    :meth:`finish` instead, with the parts already combined elementwise by a
    hoplite reduce tree.
    """

    def __init__(
        self,
        op: str,
        fields: tuple[str, ...] | None,
        axes: tuple[int, ...],
        final: Callable[[Any], Any],
        template: Any,
        reject: str = "",
    ) -> None:
        self.op = op
        self.fields = fields
        self.axes = axes
        self.final = final
        self.template = template  # nested lists of indices into the parts
        self.reject = reject  # dtype kinds (numpy's dtype.kind) not combined by ``op``
        self.depth = _depth(template)

    def __call__(self, *parts: Any) -> Any:
        return self.final(_nest(self.template, parts))

    def accepts(self, dtype: np.dtype) -> bool:
        """Whether parts of ``dtype`` may be combined elementwise by ``op``
        (``Bag.sum()`` counts bools, where ``np.add`` would or them)."""
        return dtype.kind not in self.reject

    def finish(self, combined: Any) -> Any:
        """The aggregate's result from the elementwise combination of all parts
        (a part-shaped array, or a dict of them for ``mean``)."""
        nested: Any = combined
        for _ in range(self.depth):
            nested = [nested]
        return self.final(nested)

    def parts_fit(self, shape: tuple[int, ...]) -> bool:
        """Whether parts of ``shape`` may be combined elementwise: extent 1
        along every reduced axis (what Dask's per-chunk step produces)."""
        return all(-len(shape) <= a < len(shape) and shape[a] == 1 for a in self.axes)

    def __repr__(self) -> str:
        return f"GraphReduce<{self.op}{'/' + ','.join(self.fields) if self.fields else ''}>"

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            GraphReduce,
            (self.op, self.fields, self.axes, self.final, self.template, self.reject),
        )


def unfuse_aggregates(
    dsk: Mapping[Key, Any], recognized: Callable[[Any], Aggregate | None] = recognize
) -> dict[Key, Any]:
    """``dsk`` with aggregates (those ``recognized`` returns one for) taken out
    of fused tasks.

    Dask's linear fusion (``fuse_linear_task_spec``) merges the last aggregate
    of a reduction with what follows it (e.g. the finalize step of
    ``compute``) into one ``_execute_subgraph`` task, the aggregate at the
    bottom of the chain. Such an aggregate becomes a task of its own again,
    under its original key, and the rest of the chain depends on it.
    """
    out = dict(dsk)
    for key, task in dsk.items():
        if not (isinstance(task, Task) and task.func is _execute_subgraph and task.args):
            continue
        inner = task.args[0]
        if isinstance(inner, DataNode):
            inner = inner.value
        if not isinstance(inner, dict) or len(inner) < 2:
            continue
        external = set(task.dependencies)
        for inner_key, inner_task in inner.items():
            if (
                inner_key not in dsk
                and isinstance(inner_task, Task)
                and inner_task.dependencies <= external
                and recognized(inner_task) is not None
            ):
                rest = [t for k, t in inner.items() if k != inner_key]
                try:
                    fused = Task.fuse(*rest, key=key)
                except ValueError:  # not a single-output chain after all
                    break
                out[inner_key] = inner_task
                out[key] = fused
                break
    return out


@dataclass
class _Absorption:
    """Which aggregates fold into the aggregate that consumes them: one of
    the same operator family, not requested by the client, with no other
    dependent, keeping the reduced axes (or a bag's)."""

    aggs: dict[Key, Aggregate]
    wanted: set[Key]
    n_dependents: dict[Key, int]

    @classmethod
    def of(
        cls, dsk: Mapping[Key, Any], aggs: dict[Key, Aggregate], keys: Collection[Key]
    ) -> _Absorption:
        n_dependents: dict[Key, int] = {}
        for t in dsk.values():
            for d in getattr(t, "dependencies", ()):
                n_dependents[d] = n_dependents.get(d, 0) + 1
        return cls(aggs, set(keys), n_dependents)

    def able(self, part: Key, into: Aggregate) -> Aggregate | None:
        """The aggregate ``part`` if it may fold into ``into``, else None."""
        a = self.aggs.get(part)
        if (
            a is not None
            and part not in self.wanted
            and self.n_dependents.get(part, 0) == 1
            and a.family == into.family
            and into.flat
            and (a.bag or a.keepdims)
        ):
            return a
        return None

    def expand(self, agg: Aggregate) -> tuple[list[Key], list[Key]]:
        """(parts, absorbed aggregates) of ``agg`` with every absorbable
        aggregate below it expanded into its own parts."""
        parts: list[Key] = []
        inner_keys: list[Key] = []
        for part in _flat(agg.structure):
            inner = self.able(part, agg)
            if inner is None:
                parts.append(part)
            else:
                sub, sub_inner = self.expand(inner)
                parts.extend(sub)
                inner_keys.append(part)
                inner_keys.extend(sub_inner)
        return parts, inner_keys


def rewrite_graph(
    dsk: Mapping[Key, Any],
    keys: Collection[Key],
    max_inputs: int,
    *,
    arrays: bool = True,
    bags: bool = True,
) -> tuple[dict[Key, Any], int]:
    """Rewrite the aggregate tasks of ``dsk`` (see the module docstring):
    those of dask.array reductions if ``arrays``, of dask.bag folds if ``bags``.

    ``keys`` are the keys the client asked for (never absorbed). Returns the
    new graph and the number of :class:`GraphReduce` tasks in it.
    """

    def wanted_kind(task: Any) -> Aggregate | None:
        a = recognize(task)
        return a if a is not None and (bags if a.bag else arrays) else None

    if not (arrays or bags):
        return dict(dsk), 0
    dsk = unfuse_aggregates(dsk, wanted_kind)
    aggs = {k: a for k, t in dsk.items() if (a := wanted_kind(t)) is not None}
    if not aggs:
        return dsk, 0
    absorb = _Absorption.of(dsk, aggs, keys)
    absorbed: set[Key] = set()
    rewritten: dict[Key, Task] = {}
    # Start at the aggregates no dependent can absorb; a subtree collapses into
    # one reduction when it has at most ``max_inputs`` parts, else its root
    # keeps its direct parts and each aggregate among them is tried in turn.
    parts_of = {k: set(_flat(a.structure)) for k, a in aggs.items()}
    todo = [
        k for k in aggs if not any(k in parts_of[o] and absorb.able(k, a) for o, a in aggs.items())
    ]
    while todo:
        key = todo.pop()
        agg = aggs[key]
        parts, inner = absorb.expand(agg) if agg.flat else ([], [])
        if inner and len(parts) <= max_inputs:
            absorbed.update(inner)
            template: Any = list(range(len(parts)))
        else:
            parts = _flat(agg.structure)
            template = _indexed(agg.structure, {k: i for i, k in enumerate(parts)})
            todo.extend(p for p in parts if p in aggs and p not in rewritten)
        fn = GraphReduce(agg.op, agg.fields, agg.axes, agg.final, template, agg.reject)
        rewritten[key] = Task(key, fn, *(TaskRef(p) for p in parts))
    out = {k: v for k, v in dsk.items() if k not in absorbed}
    out.update(rewritten)
    return out, len(rewritten)
