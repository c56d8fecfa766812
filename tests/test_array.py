"""dask.array reductions through hoplite's reduce trees give what Dask gives."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import dask_hoplite.array as dha


@pytest.fixture(autouse=True)
def through_the_tree():
    """These arrays are small: force the streaming tree (not the one-task path)."""
    with dask.config.set({"hoplite.min-bytes": 0}):
        yield


def check(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    else:
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
def test_stacked_arrays_reduced_along_the_stacking_axis(client, op):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(1, 3, 50_000).astype("i8") for _ in range(8)]
    x = da.stack([da.from_array(a, chunks=-1) for a in arrays])  # 8 chunks of (1, 50000)
    got = getattr(dha, op)(x, axis=0).result()
    check(got, getattr(x, op)(axis=0).compute())
    check(got, getattr(np, op)(np.stack(arrays), axis=0))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_chunked_in_every_dimension(client, axis):
    a = np.random.default_rng(2).random((6, 40, 30)).astype("f4")
    x = da.from_array(a, chunks=(2, 20, 15))
    check(dha.sum(x, axis=axis).result(), x.sum(axis=axis).compute())
    check(dha.mean(x, axis=axis).result(), x.mean(axis=axis).compute())


def test_small_integer_dtypes_promote_like_numpy(client):
    a = np.arange(64, dtype="i1").reshape(8, 8)
    x = da.from_array(a, chunks=(1, 8))
    check(dha.sum(x, axis=0).result(), a.sum(axis=0))


def test_bad_arguments(client):
    x = da.ones((4, 4), chunks=2)
    with pytest.raises(ValueError, match="op must be one of"):
        dha.reduction(x, "median")
    with pytest.raises(ValueError, match="axis must be an int"):
        dha.sum(x, axis=2)
    with pytest.raises(TypeError, match="dask.array.Array"):
        dha.sum(np.ones(3))
