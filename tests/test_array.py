"""dask.array reductions written as usual run as hoplite reduce trees and give
what Dask gives."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
from dask._task_spec import convert_legacy_graph, execute_graph
from dask.array.optimization import optimize
from distributed import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite.graph_reductions.recognize import recognize
from dask_hoplite.graph_reductions.rewrite import GraphReduce, rewrite_graph

OPS = ["sum", "prod", "min", "max", "mean"]


def taken_over(client: Client) -> int:
    """How many aggregate tasks the workers have run as reduce trees so far."""
    stats = client.run(lambda dask_worker: dask_worker.plugins["hoplite-worker"].stats)
    return sum(s.get("graph-reductions", 0) for s in stats.values())


def check(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    else:
        np.testing.assert_array_equal(got, expected)


def stacked(arrays):
    """One chunk per array, stacked along a new axis 0."""
    return da.stack([da.from_array(a, chunks=-1) for a in arrays])


def spread(client, arrays):
    """Like :func:`stacked`, with the chunks spread over the workers (what a
    user builds from per-worker results)."""
    futures = client.scatter(list(arrays), hash=False)
    assert len({w for ws in client.who_has(futures).values() for w in ws}) > 1
    return da.stack(
        [
            da.from_delayed(f, shape=a.shape, dtype=a.dtype)
            for f, a in zip(futures, arrays, strict=True)
        ]
    )


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["i1", "i8", "u2", "f4", "f8", "?"])
def test_unchanged_user_code_runs_as_a_reduce_tree(cluster_client, op, dtype):
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, 3, 4_000).astype(dtype) for _ in range(8)]
    before = taken_over(cluster_client)
    got = getattr(spread(cluster_client, arrays), op)(axis=0).compute()
    assert taken_over(cluster_client) == before + 1
    with dask.config.set(scheduler="sync"):
        check(got, getattr(stacked(arrays), op)(axis=0).compute())  # Dask alone, no plugin
    check(got, getattr(np, op)(np.stack(arrays), axis=0))


def test_the_inputs_are_not_fetched_into_one_worker(cluster_client):
    arrays = [np.full(50_000, i, dtype="f8") for i in range(6)]
    x = spread(cluster_client, arrays)
    fut = cluster_client.compute(x.sum(axis=0))
    check(fut.result(), np.stack(arrays).sum(axis=0))
    # Dask's own transfers of the per-chunk sums: none (each is 400 kB).
    logs = cluster_client.run(
        lambda dask_worker: [
            k for t in dask_worker.transfer_incoming_log for k in t["keys"] if "sum" in str(k)
        ]
    )
    assert all(not keys for keys in logs.values()), logs


@pytest.mark.parametrize("axis", [0, 1, -1, (0, 1)])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_chunked_in_every_dimension(cluster_client, axis, op):
    a = np.random.default_rng(2).random((6, 40, 300)).astype("f4")
    x = da.from_array(a, chunks=(2, 20, 150)).persist()
    check(getattr(x, op)(axis=axis).compute(), getattr(a, op)(axis=axis))


def test_deep_dask_trees_collapse_into_one_reduction(cluster_client):
    arrays = [np.arange(1_000, dtype="i8") * i for i in range(20)]  # 3 levels of split_every=4
    x = spread(cluster_client, arrays)
    before = taken_over(cluster_client)
    check(x.sum(axis=0).compute(), np.stack(arrays).sum(axis=0))
    assert taken_over(cluster_client) == before + 1


def test_small_results_stay_on_dasks_path(cluster_client):
    x = da.ones((8, 10), chunks=(1, 10)).persist()  # 80-byte parts
    before = taken_over(cluster_client)
    check(x.sum(axis=0).compute(), np.full(10, 8.0))
    assert taken_over(cluster_client) == before


@pytest.mark.filterwarnings("ignore:Scheduler already contains a plugin")
def test_switched_off_runs_dasks_graph(cluster_client):
    x = spread(cluster_client, [np.ones(5_000) for _ in range(4)])
    try:
        with dask.config.set({"hoplite.array.reductions": False}):
            cluster_client.register_plugin(dh.Hoplite())
        before = taken_over(cluster_client)
        check(x.sum(axis=0).compute(), np.full(5_000, 4.0))
        assert taken_over(cluster_client) == before
    finally:
        cluster_client.register_plugin(dh.Hoplite())
    before = taken_over(cluster_client)
    check(x.sum(axis=0).compute(), np.full(5_000, 4.0))
    assert taken_over(cluster_client) == before + 1


def test_other_reductions_are_left_alone():
    """Only aggregates whose combine is sum, prod, min, max or mean's (n,
    total) are rewritten (nansum's aggregate is a plain sum, so it is)."""
    x = da.ones((8, 4), chunks=(1, 4))
    for y in (x.std(axis=0), x.argmax(axis=0), x.any(axis=0), da.cumsum(x, axis=0)):
        dsk = convert_legacy_graph(dict(optimize(y.__dask_graph__(), y.__dask_keys__())))
        assert all(recognize(t) is None for t in dsk.values()), y


@st.composite
def reductions(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0 if i else 1, 9)) for i in range(ndim))
    chunks = tuple(draw(st.integers(1, max(1, n))) for n in shape)
    axes = draw(
        st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True).map(tuple)
    )
    op = draw(st.sampled_from(OPS))
    dtype = draw(st.sampled_from(["i2", "i8", "u1", "f4", "f8"]))
    split_every = draw(st.sampled_from([None, 2, 3]))
    max_inputs = draw(st.integers(2, 20))
    return shape, chunks, axes, op, dtype, split_every, max_inputs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reductions())
def test_rewritten_graph_computes_what_dask_computes(case):
    """The rewrite alone (every aggregate a GraphReduce, trees collapsed up to
    max_inputs) leaves every result as Dask's graph computes it."""
    shape, chunks, axes, op, dtype, split_every, max_inputs = case
    a = np.random.default_rng(3).integers(1, 4, shape).astype(dtype)
    x = da.from_array(a, chunks=chunks)
    y = getattr(x, op)(axis=axes, split_every=split_every)
    keys = list(dask.core.flatten(y.__dask_keys__()))
    dsk = convert_legacy_graph(dict(optimize(y.__dask_graph__(), keys)))
    new, n = rewrite_graph(dsk, keys, max_inputs)
    assert n == sum(isinstance(getattr(t, "func", None), GraphReduce) for t in new.values())
    for t in new.values():
        if isinstance(getattr(t, "func", None), GraphReduce) and len(axes) == 1:
            assert len(t.dependencies) <= max(max_inputs, split_every or 4)
    try:
        theirs = execute_graph(dsk)
    except ValueError as e:  # e.g. min of nothing: ours must refuse alike
        with pytest.raises(type(e)):
            execute_graph(new)
        return
    ours = execute_graph(new)
    for k in keys:
        check(np.asarray(ours[k]), np.asarray(theirs[k]))


def test_matrix_products_sum_their_blocks_as_a_reduce_tree(cluster_client):
    """``x.T @ x`` ends in a sum of the row blocks' partial products
    (``_chunk_sum``, no concatenation): one reduce tree, numpy's result."""
    blocks = [np.random.default_rng(i).random((30, 40)).astype("f4") for i in range(6)]
    futures = cluster_client.scatter(blocks, hash=False)
    x = da.concatenate([da.from_delayed(f, shape=(30, 40), dtype="f4") for f in futures])
    before = taken_over(cluster_client)
    got = (x.T @ x).compute()
    assert taken_over(cluster_client) == before + 1
    a = np.concatenate(blocks)
    check(got, a.T @ a)


@pytest.mark.parametrize("split_every", [None, 2, 3])
@pytest.mark.parametrize("row_chunks", [1, 2, 5, 9])
@pytest.mark.parametrize("product", ["matmul", "tensordot", "vector"])
def test_rewritten_matrix_products_compute_what_dask_computes(split_every, row_chunks, product):
    a = np.random.default_rng(4).integers(0, 5, (9, 4)).astype("i4")
    x = da.from_array(a, chunks=(row_chunks, 2))
    with dask.config.set({"split_every": split_every} if split_every else {}):
        y = {
            "matmul": lambda: x.T @ x,
            "tensordot": lambda: da.tensordot(x, x, axes=((0,), (0,))),
            "vector": lambda: x[:, 0] @ x,
        }[product]()
    keys = list(dask.core.flatten(y.__dask_keys__()))
    dsk = convert_legacy_graph(dict(optimize(y.__dask_graph__(), keys)))
    new, n = rewrite_graph(dsk, keys, max_inputs=4)
    assert n >= (1 if -(-9 // row_chunks) > 1 else 0)
    ours, theirs = execute_graph(new), execute_graph(dsk)
    for k in keys:
        check(np.asarray(ours[k]), np.asarray(theirs[k]))
