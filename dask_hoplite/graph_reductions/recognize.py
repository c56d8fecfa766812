"""Recognising the aggregate tasks of dask.array reductions and dask.bag folds
in a task graph: :func:`recognize` returns the :class:`Aggregate` a task is,
or None. Pure: reads task objects, runs nothing.

dask.array builds ``F(_concatenate2(parts, axes))`` with ``F`` one of numpy's
sum, prod, min, max (or ``mean_combine`` / ``mean_agg`` on ``{"n", "total"}``
dicts), and ``x @ y`` / ``tensordot`` end in ``_chunk_sum(parts)``, an
elementwise add of parts with extent 1 along the contracted axis; dask.bag builds ``empty_safe_aggregate(aggregate, parts, is_last)``
with ``aggregate`` a fold by a binary operator of :data:`BAG_BINOPS` or the
builtin ``sum``. The rewrite that uses these is :mod:`dask_hoplite.graph_reductions.rewrite`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask._task_spec import Alias, DataNode, Task, TaskRef

try:
    from dask._task_spec import _identity_cast
except ImportError:  # a release without it: the graph reductions turn off (compat), not this import
    _identity_cast = None  # type: ignore[assignment]

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


def _contraction_sums() -> set[Any]:
    """The aggregate of the sums that end ``x @ y`` and ``tensordot``
    (``_sum_wo_cat``): elementwise adds of parts that have extent 1 along the
    contracted axis, with no concatenation."""
    try:
        from dask.array.routines import _chunk_sum
    except ImportError:  # pragma: no cover
        return set()
    return {_chunk_sum}


_CONTRACTION_SUMS = _contraction_sums()

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
    if isinstance(func, functools.partial) and func.func in _MEAN_FUNCTIONS | _CONTRACTION_SUMS:
        kw = func.keywords
        if set(kw) - {"axis", "keepdims", "dtype"} or func.args:
            return None
        op = "sum"
        fields = MEAN_FIELDS if func.func in _MEAN_FUNCTIONS else None
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
