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
:meth:`dask_hoplite.scheduler.Hoplite._create_taskstate_from_graph`):

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
  (:meth:`dask_hoplite.worker.HopliteWorker.run_graph_reduce`).

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
associative and commutative on numpy arrays (:data:`BAG_BINOPS`: ``operator.add``,
``np.add``, ``np.maximum``, ...), written as ``fold(binop)`` /
``fold(binop, combine)`` builds it, or is the builtin ``sum`` of ``Bag.sum()``.
The partial results become inputs of a reduce tree when they turn out to be
numpy arrays of one shape and dtype, at least ``min-bytes``; anything else (a
bag of Python numbers, lists, empty partitions) runs Dask's own aggregate on
fetched parts, with the same result as without the plugin.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask._task_spec import (
    Alias,
    DataNode,
    Task,
    TaskRef,
    _execute_subgraph,
    _identity_cast,
)
from dask.typing import Key

logger = logging.getLogger(__name__)

#: Fields of the per-chunk results of ``mean``: dicts of arrays, each summed.
MEAN_FIELDS = ("n", "total")


def _reduce_functions() -> dict[Any, str]:
    table: dict[Any, str] = {}
    for fn, op in [
        (np.sum, "sum"),
        (np.prod, "prod"),
        (np.min, "min"),
        (np.max, "max"),
        (np.amin, "min"),
        (np.amax, "max"),
    ]:
        table[fn] = op
    try:
        from dask.array import chunk

        for name, op in [("sum", "sum"), ("prod", "prod"), ("min", "min"), ("max", "max")]:
            chunk_fn = getattr(chunk, name, None)
            if chunk_fn is not None:
                table[chunk_fn] = op
        from dask.array.reductions import chunk_max, chunk_min

        table[chunk_max] = "max"  # np.max/np.min that let empty chunks through
        table[chunk_min] = "min"
    except ImportError:  # pragma: no cover - dask.array needs numpy, which we have
        pass
    return table


def _mean_functions() -> set[Any]:
    try:
        from dask.array.reductions import mean_agg, mean_combine
    except ImportError:  # pragma: no cover
        return set()
    return {mean_agg, mean_combine}


_REDUCE_FUNCTIONS = _reduce_functions()
_MEAN_FUNCTIONS = _mean_functions()

#: Binary operators of dask.bag folds that combine two numpy arrays of one
#: shape elementwise, associatively and commutatively (so a tree may combine
#: the parts in any order), and the numpy ufunc each one calls on arrays.
BAG_BINOPS: dict[Any, str] = {
    operator.add: "add",
    operator.mul: "multiply",
    operator.and_: "bitwise_and",
    operator.or_: "bitwise_or",
    operator.xor: "bitwise_xor",
    **{
        getattr(np, name): name
        for name in [
            "add",
            "multiply",
            "maximum",
            "minimum",
            "fmax",
            "fmin",
            "bitwise_and",
            "bitwise_or",
            "bitwise_xor",
            "logical_and",
            "logical_or",
            "logical_xor",
        ]
    },
}


@dataclass(frozen=True)
class Aggregate:
    """A recognised aggregate task: ``final(nested parts)``."""

    op: str  # the elementwise combine: sum, prod, min, max, or a ufunc's name (bag)
    fields: tuple[str, ...] | None  # dict parts (mean): combine each field
    axes: tuple[int, ...]  # dask.array: the reduced axes; dask.bag: ()
    keepdims: bool
    final: Callable[[Any], Any]
    structure: Any  # nested lists (depth len(axes), 1 for a bag) of part keys
    bag: bool = False
    reject: str = ""  # dtype kinds whose parts may not take the tree (see GraphReduce)

    @property
    def family(self) -> tuple[Any, ...]:
        return (self.op, self.fields, self.axes, self.bag, self.reject)

    @property
    def flat(self) -> bool:
        """Whether the parts form one flat list (what absorption needs)."""
        return self.bag or len(self.axes) == 1


def _nested_keys(node: Any, depth: int) -> Any:
    """The nested list of keys a list-building task holds, or None."""
    if depth == 0:
        if isinstance(node, (Alias, TaskRef)):
            return node.target if isinstance(node, Alias) else node.key
        return None
    if isinstance(node, Task) and node.func is _identity_cast and node.kwargs.get("typ") is list:
        items = [_nested_keys(a, depth - 1) for a in node.args]
        if items and all(i is not None for i in items):
            return items
    return None


def _axes(kw: Mapping[str, Any]) -> tuple[int, ...] | None:
    axis = kw.get("axis")
    if isinstance(axis, (tuple, list)) and axis and all(isinstance(a, int) for a in axis):
        return tuple(axis)
    return None


def _bag_operator(aggregate: Any) -> tuple[str, str] | None:
    """(ufunc name, rejected dtype kinds) of a dask.bag aggregate function, or
    None if it is not a recognised elementwise fold."""
    if aggregate is sum:
        # sum(parts) is 0 + p0 + p1 + ...: np.add, except that bool parts are
        # counted (0 + a bool array is an int array), which np.add does not do.
        return ("add", "b")
    func = getattr(aggregate, "func", None)
    args = getattr(aggregate, "args", None)
    keywords = getattr(aggregate, "keywords", None)
    try:
        from dask.bag.core import _reduce
    except ImportError:  # pragma: no cover - dask.bag needs only toolz
        return None
    if (
        func not in (_reduce, functools.reduce)
        or keywords
        or not (isinstance(args, tuple) and len(args) == 1)
    ):
        return None
    try:
        op = BAG_BINOPS.get(args[0])
    except TypeError:  # unhashable
        return None
    return None if op is None else (op, "")


def _recognize_bag(task: Task) -> Aggregate | None:
    try:
        from dask.bag.core import empty_safe_aggregate
    except ImportError:  # pragma: no cover
        return None
    if task.func is not empty_safe_aggregate or task.kwargs or len(task.args) != 3:
        return None
    aggregate, parts, is_last = (a.value if isinstance(a, DataNode) else a for a in task.args)
    if not isinstance(is_last, bool):
        return None
    found = _bag_operator(aggregate)
    structure = _nested_keys(parts, 1)
    if found is None or structure is None:
        return None
    final = functools.partial(empty_safe_aggregate, aggregate, is_last=is_last)
    return Aggregate(found[0], None, (), True, final, structure, bag=True, reject=found[1])


def recognize(task: Any) -> Aggregate | None:
    """The :class:`Aggregate` that ``task`` is, or None."""
    if isinstance(task, Task) and len(task.args) == 3:
        return _recognize_bag(task)
    if not isinstance(task, Task) or task.kwargs or len(task.args) != 1:
        return None
    func = task.func
    fields: tuple[str, ...] | None
    if isinstance(func, functools.partial) and func.func in _MEAN_FUNCTIONS:
        kw = func.keywords
        if set(kw) - {"axis", "keepdims", "dtype"} or func.args:
            return None
        op, fields = "sum", MEAN_FIELDS
    else:
        # toolz.compose(F, partial(_concatenate2, axes=...)): ``first`` runs first.
        first, rest = getattr(func, "first", None), getattr(func, "funcs", None)
        if not (isinstance(rest, tuple) and len(rest) == 1):
            return None
        from dask.array.core import _concatenate2

        f = rest[0]
        if not (
            isinstance(first, functools.partial)
            and first.func is _concatenate2
            and not first.args
            and set(first.keywords) == {"axes"}
            and isinstance(f, functools.partial)
            and not f.args
        ):
            return None
        try:
            op_name = _REDUCE_FUNCTIONS.get(f.func)
        except TypeError:  # unhashable
            return None
        kw = f.keywords
        if op_name is None or set(kw) - {"axis", "keepdims", "dtype"}:
            return None
        if list(first.keywords["axes"]) != sorted(kw.get("axis") or ()):
            return None
        op, fields = op_name, None
    axes = _axes(kw)
    if axes is None:
        return None
    structure = _nested_keys(task.args[0], len(axes))
    if structure is None:
        return None
    return Aggregate(op, fields, axes, bool(kw.get("keepdims", False)), func, structure)


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
    wanted = set(keys)
    n_dependents: dict[Key, int] = {}
    for t in dsk.values():
        for d in getattr(t, "dependencies", ()):
            n_dependents[d] = n_dependents.get(d, 0) + 1

    def absorbable(part: Key, into: Aggregate) -> Aggregate | None:
        a = aggs.get(part)
        if (
            a is not None
            and part not in wanted
            and n_dependents.get(part, 0) == 1
            and a.family == into.family
            and into.flat
            and (a.bag or a.keepdims)
        ):
            return a
        return None

    def expand(agg: Aggregate) -> tuple[list[Key], list[Key]]:
        """(parts, absorbed aggregates) of ``agg`` with every absorbable
        aggregate below it expanded into its own parts."""
        parts: list[Key] = []
        inner_keys: list[Key] = []
        for part in _flat(agg.structure):
            inner = absorbable(part, agg)
            if inner is None:
                parts.append(part)
            else:
                sub, sub_inner = expand(inner)
                parts.extend(sub)
                inner_keys.append(part)
                inner_keys.extend(sub_inner)
        return parts, inner_keys

    absorbed: set[Key] = set()
    rewritten: dict[Key, Task] = {}
    # Start at the aggregates no dependent can absorb; a subtree collapses into
    # one reduction when it has at most ``max_inputs`` parts, else its root
    # keeps its direct parts and each aggregate among them is tried in turn.
    parts_of = {k: set(_flat(a.structure)) for k, a in aggs.items()}
    todo = [
        k for k in aggs if not any(k in parts_of[o] and absorbable(k, a) for o, a in aggs.items())
    ]
    while todo:
        key = todo.pop()
        agg = aggs[key]
        parts, inner = expand(agg) if agg.flat else ([], [])
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
