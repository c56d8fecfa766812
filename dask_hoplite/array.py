"""dask.array reductions as pipelined reduce trees.

    import dask_hoplite.array as dha

    total = dha.sum(x, axis=0)        # a Future of the numpy result
    total.result()                    # == x.sum(axis=0).compute()

Each block is first reduced along ``axis`` where it lives (no transfer), then
the per-block partial results of every column of blocks are combined by
:func:`dask_hoplite.reduce`: a tree whose edges stream partial sums block by
block, instead of Dask's tree of tasks (``split_every``) where every edge is a
whole-object fetch and every level waits for the one below.

Why a helper and not ``x.sum(axis=0)`` itself: the integration point would be
the graph Dask builds for the reduction, and low-level fusion and graph
rewrites change those task names and annotations from release to release
(dask/dask#7036); a helper on the collection is explicit and stable. It is
worth it when the partial results are large (the typical case: stacked arrays
reduced along the stacking axis), since small partials gain nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from dask import delayed
from distributed import Future, default_client

from dask_hoplite.collectives import reduce as _reduce

_BLOCK: dict[str, Any] = {
    "sum": np.sum,
    "prod": np.prod,
    "min": np.min,
    "max": np.max,
    "mean": np.sum,
}
_COMBINE = {"sum": "sum", "prod": "prod", "min": "min", "max": "max", "mean": "sum"}


def _block_reduce(block: np.ndarray, op: str, axis: int) -> np.ndarray:
    return np.asarray(_BLOCK[op](block, axis=axis))


def _assemble(grid: Any, divide_by: int | None) -> np.ndarray:
    out = np.block(grid) if isinstance(grid, list) else np.asarray(grid)
    if divide_by is not None:
        out = out / divide_by
    return np.asarray(out)


def _nest(results: dict[tuple[int, ...], Any], shape: tuple[int, ...]) -> Any:
    """A nested list of ``results`` in C order, as ``np.block`` wants it."""
    if not shape:
        return results[()]

    def build(prefix: tuple[int, ...], dims: tuple[int, ...]) -> Any:
        if not dims:
            return results[prefix]
        return [build((*prefix, i), dims[1:]) for i in range(dims[0])]

    return build((), shape)


def reduction(x: Any, op: str = "sum", axis: int = 0) -> Future:
    """``x.<op>(axis=axis)`` as pipelined reduce trees; returns a Future."""
    import dask.array as da

    if not isinstance(x, da.Array):
        raise TypeError(f"expected a dask.array.Array, got {type(x).__name__}")
    if op not in _BLOCK:
        raise ValueError(f"op must be one of {sorted(_BLOCK)}, got {op!r}")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis must be an int in [{-x.ndim}, {x.ndim}), got {axis!r}")
    axis %= x.ndim
    client = default_client()
    blocks = np.moveaxis(x.to_delayed(), axis, 0)  # (n, *other block indices)
    rest_shape = blocks.shape[1:]
    results: dict[tuple[int, ...], Any] = {}
    for idx in itertools.product(*(range(n) for n in rest_shape)):
        column = blocks[(slice(None), *idx)]
        partials = client.compute([delayed(_block_reduce)(b, op, axis) for b in column])
        results[idx] = _reduce(partials, _COMBINE[op])
    grid = _nest(results, rest_shape)
    divide_by = x.shape[axis] if op == "mean" else None
    return client.submit(_assemble, grid, divide_by, pure=False)


def sum(x: Any, axis: int = 0) -> Future:  # noqa: A001 - mirrors numpy's name
    return reduction(x, "sum", axis)


def prod(x: Any, axis: int = 0) -> Future:
    return reduction(x, "prod", axis)


def min(x: Any, axis: int = 0) -> Future:  # noqa: A001
    return reduction(x, "min", axis)


def max(x: Any, axis: int = 0) -> Future:  # noqa: A001
    return reduction(x, "max", axis)


def mean(x: Any, axis: int = 0) -> Future:
    return reduction(x, "mean", axis)
