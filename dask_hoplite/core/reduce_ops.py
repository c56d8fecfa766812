"""Reduction operators: which ufunc combines two partial results, and in what
dtype. Pure numpy, no I/O.

The result of ``reduce(inputs, op)`` is defined as numpy's own reduction over a
new leading axis, e.g. ``np.sum(np.stack(inputs), axis=0)``: same shape as each
input, and the dtype numpy's reduction gives (``int8`` sums to ``int64``, ``min``
keeps the dtype, ``mean`` of integers is ``float64``). Any binary numpy ufunc
works too, combined in the dtype the ufunc itself returns for two inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_NAMED = {"sum": "add", "prod": "multiply", "min": "minimum", "max": "maximum", "mean": "add"}
_REDUCTION: dict[str, Any] = {
    "sum": np.sum,
    "prod": np.prod,
    "min": np.min,
    "max": np.max,
    "mean": np.mean,
}


@dataclass(frozen=True)
class ReduceOp:
    """A resolved operator: ``name`` as given, ``ufunc`` that combines two
    partial results, and whether the result is divided by the count (mean)."""

    name: str
    ufunc: np.ufunc
    mean: bool

    def result_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype numpy's own reduction over a stack of ``dtype`` arrays gives."""
        reduction: Any = _REDUCTION.get(self.name)
        if reduction is not None:
            return np.dtype(reduction(np.zeros((2, 1), dtype=dtype), axis=0).dtype)
        a = np.zeros(1, dtype=dtype)
        return np.dtype(self.ufunc(a, a).dtype)

    def combine(self, out: np.ndarray, other: np.ndarray) -> None:
        """``out = op(out, other)`` in place."""
        self.ufunc(out, other, out=out)

    def finish(self, out: np.ndarray, count: int) -> None:
        if self.mean:
            np.true_divide(out, count, out=out, casting="unsafe")


def resolve_op(op: Any) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`: one of sum, prod, min, max, mean, or any
    binary numpy ufunc (or its name). Raises ``ValueError`` naming what is
    accepted."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = op
        ufunc = getattr(np, _NAMED.get(op, op), None)
    elif isinstance(op, np.ufunc):
        name, ufunc = op.__name__, op
    else:
        name, ufunc = repr(op), None
    if not isinstance(ufunc, np.ufunc) or ufunc.nin != 2 or ufunc.nout != 1:
        raise ValueError(
            f"op must be 'sum', 'prod', 'min', 'max', 'mean' or a binary numpy ufunc "
            f"(e.g. np.add, 'logaddexp'); got {op!r}"
        )
    return ReduceOp(name, ufunc, name == "mean")


def reference(op: Any, arrays: list[np.ndarray]) -> np.ndarray:
    """What ``reduce(arrays, op)`` must equal (up to the order of combination)."""
    r = resolve_op(op)
    reduction: Any = _REDUCTION.get(r.name)
    if reduction is not None:
        return np.asarray(reduction(np.stack(arrays), axis=0))
    out = np.asarray(arrays[0]).astype(r.result_dtype(arrays[0].dtype))
    for a in arrays[1:]:
        out = r.ufunc(out, a)
    return np.asarray(out)
