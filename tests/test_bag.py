"""dask.bag folds of numpy arrays written as usual run as hoplite reduce trees
and give what Dask gives; other bags are left to Dask."""

from __future__ import annotations

import functools
import operator

import dask
import dask.bag as db
import numpy as np
import pytest
from dask._task_spec import convert_legacy_graph, execute_graph
from distributed import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite.graph_reductions.recognize import recognize
from dask_hoplite.graph_reductions.rewrite import GraphReduce, rewrite_graph


def stats(client: Client) -> dict[str, int]:
    per_worker = client.run(lambda dask_worker: dask_worker.plugins["hoplite-worker"].stats)
    return {
        name: sum(s.get(name, 0) for s in per_worker.values())
        for name in ("graph-reductions", "graph-reduction-fallbacks")
    }


KEEP: list = []  # the scattered partitions of the test running now


@pytest.fixture(autouse=True)
def _release_partitions():
    yield
    KEEP.clear()


def spread(client: Client, partitions: list[list]) -> db.Bag:
    """A bag whose partitions live on different workers (what a user builds
    from per-worker results; the test keeps them alive)."""
    futures = client.scatter(partitions, hash=False)
    assert len({w for ws in client.who_has(futures).values() for w in ws}) > 1
    KEEP.extend(futures)
    return db.from_delayed(futures)


def check(got, expected):
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    else:
        np.testing.assert_array_equal(got, expected)


def partitions_of(dtype: str, n: int = 8, per: int = 2, size: int = 3_000) -> list[list]:
    rng = np.random.default_rng(4)
    return [[rng.integers(1, 4, size).astype(dtype) for _ in range(per)] for _ in range(n)]


BINOPS = [operator.add, np.add, np.maximum, np.minimum, operator.mul]


@pytest.mark.parametrize("binop", BINOPS, ids=lambda f: getattr(f, "__name__", repr(f)))
@pytest.mark.parametrize("dtype", ["i1", "i8", "u2", "f4", "f8"])
def test_unchanged_fold_runs_as_a_reduce_tree(cluster_client, binop, dtype):
    parts = partitions_of(dtype)
    before = stats(cluster_client)
    got = spread(cluster_client, parts).fold(binop).compute()
    after = stats(cluster_client)
    assert after["graph-reductions"] == before["graph-reductions"] + 1
    assert after["graph-reduction-fallbacks"] == before["graph-reduction-fallbacks"]
    check(got, functools.reduce(binop, [a for p in parts for a in p]))


def test_bag_sum_and_fold_with_combine_and_initial(cluster_client):
    parts = partitions_of("f8", n=12)  # 2 levels of Dask's split_every=8: one reduction
    flat = [a for p in parts for a in p]
    bag = spread(cluster_client, parts)
    before = stats(cluster_client)["graph-reductions"]
    check(bag.sum().compute(), sum(flat))
    check(bag.fold(np.add, np.add, initial=np.zeros(3_000)).compute(), sum(flat))
    check(bag.fold(lambda acc, x: acc + 2 * x, np.add, initial=0).compute(), 2 * sum(flat))
    assert stats(cluster_client)["graph-reductions"] == before + 3


def test_the_partial_results_are_not_fetched_into_one_worker(cluster_client):
    """The aggregate's inputs, the partitions' partial results, stay where
    they were made. Dask names them ``reduce-part-<token>``: aliases of the
    fused ``bag-from-delayed-...-reduce-part-<token>`` tasks that compute
    them. An alias Dask places away from its fused task fetches that task's
    output (Dask's own placement, seen now and then in the module's earlier
    folds); that is no input of the aggregate, and not counted here."""
    bag = spread(cluster_client, partitions_of("f8", n=6, size=50_000))
    expected = sum(a for p in partitions_of("f8", 6, 2, 50_000) for a in p)
    check(bag.fold(operator.add).compute(), expected)
    logs = cluster_client.run(
        lambda dask_worker: [
            k
            for t in dask_worker.transfer_incoming_log
            for k in t["keys"]
            if isinstance(k, tuple) and str(k[0]).startswith("reduce-part-")
        ]
    )
    assert all(not keys for keys in logs.values()), logs


def test_bool_sums_count_as_dask_does(cluster_client):
    """Builtin ``sum`` of bool parts counts (0 + a bool array is an int
    array); np.add would or them, so such parts go Dask's way."""
    parts = partitions_of("?", n=4)
    bag = spread(cluster_client, parts)
    check(bag.sum().compute(), sum(a for p in parts for a in p))  # int parts: a tree
    before = stats(cluster_client)
    anyof = bag.reduction(lambda p: functools.reduce(np.logical_or, p), sum).compute()
    check(anyof, sum(functools.reduce(np.logical_or, p) for p in parts))
    assert anyof.max() > 1
    after = stats(cluster_client)
    assert after["graph-reduction-fallbacks"] == before["graph-reduction-fallbacks"] + 1


@pytest.mark.parametrize(
    "partitions",
    [
        [[1, 2], [3], [4, 5, 6]],  # numbers
        [[[1], [2]], [[3]], [[4, 5]]],  # lists: + concatenates
        [[np.ones(3_000)], [], [np.ones(3_000)], []],  # empty partitions
        [[np.ones(3_000)], [np.ones(1)], [np.full(3_000, 2.0)]],  # arrays that broadcast
    ],
    ids=["numbers", "lists", "empty-partitions", "broadcasting"],
)
def test_other_bags_give_what_dask_gives(cluster_client, partitions):
    expected = functools.reduce(operator.add, [x for p in partitions for x in p])
    got = spread(cluster_client, partitions).fold(operator.add).compute()
    if isinstance(expected, np.ndarray):
        check(got, expected)
    else:
        assert got == expected


def test_differing_parts_raise_what_dask_raises(cluster_client):
    bag = spread(cluster_client, [[np.ones(3_000)], [np.ones(2_000)]])
    with pytest.raises(ValueError, match="broadcast"):
        bag.fold(operator.add).compute()
    assert cluster_client.submit(sum, [1, 2]).result() == 3  # the cluster goes on


@pytest.mark.filterwarnings("ignore:Scheduler already contains a plugin")
def test_switched_off_runs_dasks_graph(cluster_client):
    bag = spread(cluster_client, partitions_of("f8", n=4))
    try:
        with dask.config.set({"hoplite.bag.reductions": False}):
            cluster_client.register_plugin(dh.Hoplite())
        before = stats(cluster_client)["graph-reductions"]
        bag.fold(np.add).compute()
        assert stats(cluster_client)["graph-reductions"] == before
    finally:
        cluster_client.register_plugin(dh.Hoplite())
    before = stats(cluster_client)["graph-reductions"]
    bag.fold(np.add).compute()
    assert stats(cluster_client)["graph-reductions"] == before + 1


def test_other_folds_are_left_alone():
    """Only folds whose combine is a known elementwise, associative and
    commutative operator (or builtin sum) are rewritten."""
    b = db.from_sequence(range(20), npartitions=4)
    for y in (
        b.fold(operator.sub),
        b.fold(lambda a, x: a + x),
        b.reduction(sum, max),
        b.mean(),
        b.max(),
    ):
        dsk = convert_legacy_graph(dict(y.__dask_graph__()))
        assert all(recognize(t) is None for t in dsk.values()), y


ELEMENTS = st.one_of(
    st.integers(-5, 5),
    st.integers(0, 3).map(lambda i: np.arange(6, dtype="i8") * i),
    st.integers(0, 3).map(lambda i: np.full(6, i / 2)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    partitions=st.lists(st.lists(ELEMENTS, max_size=3), min_size=1, max_size=20),
    binop=st.sampled_from([operator.add, np.add, np.maximum, operator.mul, np.minimum]),
    how=st.sampled_from(["fold", "fold-combine", "sum"]),
    split_every=st.sampled_from([None, 2, 3]),
    max_inputs=st.integers(2, 20),
)
def test_rewritten_graph_computes_what_dask_computes(
    partitions, binop, how, split_every, max_inputs
):
    """The rewrite alone (every recognised aggregate a GraphReduce, Dask's
    tree collapsed up to max_inputs partitions) leaves every result as Dask's
    graph computes it, errors included."""
    bag = db.from_sequence(partitions, npartitions=len(partitions)).map_partitions(
        lambda p: list(p[0]) if p else []
    )
    if how == "sum":
        y = bag.sum(split_every=split_every)
    elif how == "fold":
        y = bag.fold(binop, split_every=split_every)
    else:
        y = bag.fold(binop, binop, initial=0, split_every=split_every)
    keys = [y.key]
    dsk = convert_legacy_graph(dict(y.__dask_graph__()))
    new, n = rewrite_graph(dsk, keys, max_inputs)
    assert n >= 1
    assert n == sum(isinstance(getattr(t, "func", None), GraphReduce) for t in new.values())
    try:
        theirs = execute_graph(dsk)[y.key]
    except Exception as e:  # e.g. a fold of nothing: ours must fail alike
        with pytest.raises(type(e)):
            execute_graph(new)
        return
    ours = execute_graph(new)[y.key]
    if isinstance(theirs, np.ndarray) or isinstance(ours, np.ndarray):
        check(ours, theirs)
    else:
        assert ours == theirs
