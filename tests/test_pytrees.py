"""Models as pytrees: collectives on dicts, lists and tuples of arrays.

The packing itself (:mod:`dask_hoplite.core.pytrees`) is tested without a
cluster; every reduction path is then tested on one (a tree, a reduce in
parts, one task for small objects, an allreduce with copies, in segments),
with a leaf type that is not numpy (``Weights``, standing in for a tensor).
"""

from __future__ import annotations

import collections

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from hypothesis import given, settings
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses
from dask_hoplite.core.pytrees import (
    check_signature,
    is_pytree,
    layout_of,
    pack,
    pack_range,
    unpack,
)
from dask_hoplite.errors import ReduceInputError


class Weights:
    """A leaf that is not a numpy array: it has ``__array__`` and is made
    from one, as a CPU tensor is."""

    def __init__(self, data):
        self.data = np.asarray(data)

    def __array__(self, dtype=None, copy=None):
        return self.data if dtype is None else self.data.astype(dtype)


class Tensor(Weights):
    """A leaf type rebuilt through its own ``from_numpy``."""

    made_by = ""

    @classmethod
    def from_numpy(cls, arr):
        t = cls(arr)
        t.made_by = "from_numpy"
        return t


def model(seed: int, dtype="f8", scale: int = 1):
    """A small MLP's parameters, as a nested dict with other leaf types."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.integers(0, 5, size=shape).astype(dtype)

    return {
        "fc1": {"weight": r(8 * scale, 4), "bias": Weights(r(8 * scale))},
        "fc2": {"weight": r(3, 8 * scale), "bias": r(3)},
        "norm": (r(), [r(2, 2), Tensor(r(5))]),
    }


def leaves(tree):
    """(path, leaf) pairs of a nested dict/list/tuple."""
    if isinstance(tree, dict):
        return [(f"{k}/{p}", v) for k in tree for p, v in leaves(tree[k])]
    if isinstance(tree, list | tuple):
        return [(f"{i}/{p}", v) for i, x in enumerate(tree) for p, v in leaves(x)]
    return [("", tree)]


def summed(trees):
    """The leaf-by-leaf sum of ``trees``, in numpy."""
    return [
        sum(np.asarray(lv[i][1]) for lv in map(leaves, trees)) for i in range(len(leaves(trees[0])))
    ]


def assert_tree(result, like, values):
    """``result`` has ``like``'s structure and leaf types and these values."""
    got, want = leaves(result), leaves(like)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, leaf), (_, ref), value in zip(got, want, values, strict=True):
        assert type(leaf) is type(ref), path
        np.testing.assert_allclose(np.asarray(leaf), value, err_msg=path)
    assert type(result) is type(like)


# -- packing, no cluster -------------------------------------------------------


def test_pack_then_unpack_gives_the_tree_back():
    tree = model(0)
    packed = pack(tree, "x")
    assert packed.flat.ndim == 1 and packed.flat.size == sum(
        np.asarray(v).size for _, v in leaves(tree)
    )
    back = unpack(packed.layout, packed.flat)
    assert_tree(back, tree, [np.asarray(v) for _, v in leaves(tree)])
    assert back["norm"][1][1].made_by == "from_numpy"
    assert isinstance(back["norm"], tuple) and isinstance(back["norm"][1], list)
    # each leaf is a view of the flat result: no copy
    assert np.shares_memory(back["fc2"]["weight"], packed.flat)


def test_dicts_filled_in_other_orders_pack_alike_and_come_back_in_theirs():
    a = {"b": np.ones(2), "a": np.zeros(3)}
    b = {"a": np.zeros(3), "b": np.ones(2)}
    pa, pb = pack(a, "a"), pack(b, "b")
    assert pa.layout.signature == pb.layout.signature
    np.testing.assert_array_equal(pa.flat, pb.flat)
    assert list(unpack(pa.layout, pa.flat)) == ["b", "a"]


def test_python_numbers_namedtuples_and_ordered_dicts_keep_their_types():
    Pair = collections.namedtuple("Pair", "x y")
    tree = collections.OrderedDict(p=Pair(1.5, np.float32(2)), n=[3], w=np.ones(2, "f4"))
    packed = pack(tree, "k")
    assert packed.flat.dtype == np.float32  # Python numbers take the arrays' dtype
    back = unpack(packed.layout, packed.flat * 2)
    assert type(back) is collections.OrderedDict and type(back["p"]) is Pair
    assert back["p"].x == 3.0 and type(back["p"].x) is float
    assert type(back["p"].y) is np.float32 and back["n"] == [6.0]


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    lo_hi=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_a_range_of_the_packing_is_that_range_of_the_whole(sizes, lo_hi):
    tree = {f"l{i}": np.arange(n, dtype="i4") + 100 * i for i, n in enumerate(sizes)}
    layout, arrays = layout_of(tree, "k")
    whole = pack(tree, "k").flat
    lo, hi = sorted(int(f * layout.size) for f in lo_hi)
    np.testing.assert_array_equal(pack_range(layout, arrays, lo, hi), whole[lo:hi])
    taken = []
    part = pack_range(
        layout, arrays, lo, hi, allocate=lambda n: taken.append(n) or np.empty(n, np.uint8)
    )
    np.testing.assert_array_equal(part, whole[lo:hi])


def test_what_is_not_a_pytree():
    assert not is_pytree(np.ones(3)) and not is_pytree(np.float64(1))
    assert is_pytree({"a": np.ones(1)}) and is_pytree([1.0]) and is_pytree(Weights([1]))
    assert not is_pytree("text") and not is_pytree(None)


@pytest.mark.parametrize(
    "tree, words",
    [
        (
            {"w": np.ones(2, "f4"), "step": np.int64(3)},
            ["2 dtypes", "float32: ['w']", "int64: ['step']"],
        ),
        ({"w": np.ones(2), "name": "fc"}, ["leaf ['name']", "is a str"]),
        ({"w": np.array(["a"])}, ["leaf ['w']", "dtype <U1"]),
        ({}, ["without leaves"]),
    ],
)
def test_a_leaf_that_cannot_be_reduced_is_named(tree, words):
    with pytest.raises(ReduceInputError) as e:
        pack(tree, "grad-3")
    for word in [*words, "'grad-3'"]:
        assert word in str(e.value)


def test_a_leaf_that_differs_is_named_with_both_inputs():
    ref = layout_of(model(0), "grad-0")[0].signature
    other = model(1)
    other["fc2"]["weight"] = np.ones((8, 3))
    with pytest.raises(
        ReduceInputError,
        match=r"leaf \['fc2'\]\['weight'\] of input 'grad-5' has shape \(8, 3\).*'grad-0' it has shape \(3, 8\)",
    ):
        check_signature(layout_of(other, "grad-5")[0].signature, "grad-5", ref, "grad-0")
    del other["fc1"]
    with pytest.raises(ReduceInputError, match=r"input 'grad-5' has no leaf \['fc1'\]\['bias'\]"):
        check_signature(layout_of(other, "grad-5")[0].signature, "grad-5", ref, "grad-0")
    with pytest.raises(ReduceInputError, match="is a pytree but input 'grad-0' is a numpy array"):
        check_signature(ref, "grad-5", None, "grad-0")


def test_a_leaf_type_that_cannot_be_rebuilt_says_what_to_add():
    class Opaque:
        def __init__(self):
            self.a = np.ones(2)

        def __array__(self, dtype=None, copy=None):
            return self.a

    packed = pack({"x": Opaque()}, "k")
    with pytest.raises(TypeError, match=r"leaf \['x'\] cannot be rebuilt as a Opaque.*from_numpy"):
        unpack(packed.layout, packed.flat)


# -- on a cluster ----------------------------------------------------------------


def scatter(client, values):
    ws = worker_addresses(client)
    # a list of one: scatter would scatter a dict's values one by one
    return [
        client.scatter([v], workers=[ws[i % len(ws)]], hash=False)[0] for i, v in enumerate(values)
    ]


PATHS = {
    "tree": {"hoplite.min-bytes": 0, "hoplite.reduce.parts": 1},
    "parts": {"hoplite.min-bytes": 0, "hoplite.reduce.parts": 3},
    "one-task": {"hoplite.min-bytes": "1 GiB"},
}


@pytest.mark.parametrize("path", list(PATHS))
def test_reduce_of_models_leaf_by_leaf(client, path):
    trees = [model(i) for i in range(5)]
    with dask.config.set(PATHS[path]):
        total = dh.reduce(scatter(client, trees), "sum")
    assert_tree(total.result(), trees[0], summed(trees))


def test_mean_of_a_model_with_k_of_n(client):
    trees = [model(i, dtype="i4") for i in range(4)]
    futures = scatter(client, trees)
    with dask.config.set(PATHS["tree"]):
        mean = dh.reduce(futures, "mean", k=3)
    used = dh.reduced_inputs(mean)
    by_key = {f.key: t for f, t in zip(futures, trees, strict=True)}
    chosen = [by_key[k] for k in used]
    result = mean.result()
    assert result["fc2"]["weight"].dtype == np.float64  # the mean of ints
    assert_tree(result, trees[0], [v / 3 for v in summed(chosen)])


@pytest.mark.parametrize("segmented", [False, True], ids=["copies", "segments"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "one-task"])
def test_allreduce_of_models_on_every_worker_in_input_order(client, segmented, tree):
    trees = [model(i, scale=50) for i in range(4)]
    futures = scatter(client, trees)
    cfg = {
        "hoplite.min-bytes": 0 if tree else "1 GiB",
        "hoplite.reduce.allreduce-segment-min-bytes": 0 if segmented else "1 GiB",
    }
    with dask.config.set(cfg):
        outputs = dh.allreduce(futures, "sum")
    expected = summed(trees)
    for out in outputs:
        assert_tree(out.result(), trees[0], expected)


def test_broadcast_gather_and_allgather_move_models_as_they_are(client):
    trees = [model(i) for i in range(3)]
    futures = scatter(client, trees)
    ws = worker_addresses(client)
    for copy in dh.broadcast(futures[0], workers=ws):
        assert_tree(copy.result(), trees[0], [np.asarray(v) for _, v in leaves(trees[0])])
    gathered = dh.gather(futures, to=ws[0]).result()
    for got, tree in zip(gathered, trees, strict=True):
        assert_tree(got, tree, [np.asarray(v) for _, v in leaves(tree)])
    for out in dh.allgather(futures):
        assert [leaves(t)[0][1].tolist() for t in out.result()] == [
            leaves(t)[0][1].tolist() for t in trees
        ]


@pytest.mark.parametrize("path", ["tree", "one-task"])
def test_a_model_whose_leaf_differs_fails_naming_the_leaf_and_the_cluster_keeps_working(
    client, path
):
    trees = [model(i) for i in range(3)]
    trees[2]["fc2"]["bias"] = np.ones(4)
    futures = scatter(client, trees)
    with dask.config.set(PATHS[path]):
        total = dh.reduce(futures, "sum")
        with pytest.raises(
            ReduceInputError,
            match=rf"leaf \['fc2'\]\['bias'\] of input '{futures[2].key}' has shape \(4,\)",
        ):
            total.result()
        again = dh.reduce(futures[:2], "sum")
    assert_tree(again.result(), trees[0], summed(trees[:2]))


def test_an_array_among_models_is_named(client):
    futures = scatter(client, [model(0), model(1), np.ones(49)])
    with dask.config.set(PATHS["tree"]):
        total = dh.reduce(futures, "sum")
    with pytest.raises(ReduceInputError, match=f"'{futures[2].key}'"):
        total.result()


def test_models_without_dask_hoplite_registered():
    """Dask alone: the same calls, one task per reduction."""
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cl,
        Client(cl) as c,
    ):
        trees = [model(i) for i in range(3)]
        futures = scatter(c, trees)
        assert_tree(dh.reduce(futures, "sum").result(), trees[0], summed(trees))
        for out in dh.allreduce(futures, "max"):
            assert_tree(
                out.result(),
                trees[0],
                [
                    np.max(np.stack([np.asarray(lv[i][1]) for lv in map(leaves, trees)]), axis=0)
                    for i in range(len(leaves(trees[0])))
                ],
            )
