"""The spread of a dead reduce node (dask_hoplite.core.tree_spread), sans-IO."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.tree_shape import plan_reduce_tree
from dask_hoplite.core.tree_spread import LiveTree, Patch, worker_load
from dask_hoplite.errors import SpreadRefused


def _small() -> LiveTree:
    """Root 0 with children 1 and 4; node 1 with children 2 and 3; 4 with 5."""
    return LiveTree((None, 0, 1, 1, 0, 4))


def test_children_go_to_the_least_loaded_nodes_outside_the_dead_node_s_subtree():
    tree = _small()
    load = {u: 0 for u in range(6)}
    load[0] = 5  # the root's worker is busy
    assert tree.inner() == {0, 1, 4}
    plan = tree.plan_spread(1, offset=100, merge_into=5, load=load)
    assert plan.parent == 0 and plan.merge_into == 5
    # 2 and 3 are inside 1's subtree; 4 and 5 are free; one child each.
    assert dict(plan.adopters) == {2: 4, 3: 5}
    tree.apply(plan)
    assert tree.gone == {1}
    assert tree.parent[2] == 4 and tree.parent[3] == 5
    assert tree.children(0) == [4] and tree.children(4) == [2, 5]
    assert tree.inner() == {0, 4, 5}
    assert tree.subtree(4) == {4, 2, 5, 3}


def test_the_parent_reads_a_patch_for_every_node_that_starts_after_its_byte():
    plan = _small().plan_spread(1, offset=100, merge_into=5, load=dict.fromkeys(range(6), 0))
    patches = plan.patches(merged_from=160, adopted_from={2: 100, 3: 130})
    assert patches == [Patch(5, 0, 100, 160, input=True), Patch(3, 0, 100, 130)]
    with pytest.raises(ValueError, match="at or after byte 100"):
        plan.patches(merged_from=90, adopted_from={2: 100, 3: 100})


@pytest.mark.parametrize(
    "dead, merge_into, down, match",
    [
        (0, 5, (), "root"),
        (1, 1, (), "cannot take"),
        (1, 5, (0,), "parent 0 is dead"),
        (1, 5, (2,), r"children \[2\] are dead"),
        (1, 5, (5,), "cannot take"),
    ],
)
def test_a_spread_that_cannot_help_is_refused(dead, merge_into, down, match):
    with pytest.raises(SpreadRefused, match=match):
        _small().plan_spread(dead, 0, merge_into, dict.fromkeys(range(6), 0), down=down)


def test_a_node_spread_already_or_with_no_adopter_is_refused():
    tree = LiveTree((None, 0, 1))
    with pytest.raises(SpreadRefused, match="no live node"):
        tree.plan_spread(1, 0, 0, load={1: 0, 2: 0})  # only its subtree is a candidate
    plan = tree.plan_spread(1, 0, 0, load={0: 0, 1: 0, 2: 0})
    tree.apply(plan)
    with pytest.raises(SpreadRefused, match="spread already"):
        tree.plan_spread(1, 0, 0, load={0: 0})


def test_worker_load_counts_streams_into_each_worker_over_every_tree():
    a, b = _small(), LiveTree((1, None, 1))
    hosts_a = ["w0", "w1", "w2", "w3", "w4", "w5"]
    hosts_b = ["w2", "w0", "w1"]
    assert worker_load([(a, hosts_a), (b, hosts_b)]) == {"w0": 4, "w1": 2, "w4": 1}


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 60),
    chain=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
    failures=st.integers(1, 8),
)
def test_spreads_keep_every_live_node_on_a_path_to_the_root(n, chain, seed, failures):
    """Whatever dies, in any order: each spread moves children outside the
    dead node's subtree, so the live nodes stay one tree, and each adopter was
    among the least loaded when chosen."""
    rng = random.Random(seed)
    tree = LiveTree(plan_reduce_tree(n, chain).parent)
    load = {u: rng.randrange(3) for u in range(n)}
    for _ in range(failures):
        alive = [u for u in range(n) if u not in tree.gone and u != tree.root]
        if not alive:
            break
        dead = rng.choice(alive)
        merge = rng.choice([u for u in range(n) if u not in tree.gone and u != dead])
        candidates = {u: c for u, c in load.items() if u not in tree.gone and u != dead}
        try:
            plan = tree.plan_spread(dead, 0, merge, candidates, rng=rng)
        except SpreadRefused as e:
            assert "no live node" in str(e)
            assert not (set(candidates) - tree.subtree(dead))
            continue
        inside = tree.subtree(dead)
        free = {u: c for u, c in candidates.items() if u not in inside}
        for _, a in plan.adopters:
            assert a not in inside
            assert free[a] == min(free.values())
            free[a] += 1
        tree.apply(plan)
        for u, c in free.items():
            load[u] = c
        for u in set(range(n)) - tree.gone:
            seen = set()
            while u != tree.root:
                assert u not in seen and u not in tree.gone
                seen.add(u)
                parent = tree.parent[u]
                assert parent is not None
                u = parent


def _job(nbytes: int = 64, block: int = 16):
    """A node's combining job over float64 blocks, as the worker builds it
    (no comm is touched by what these tests call)."""
    from dask_hoplite.core.reduce_ops import resolve_op
    from dask_hoplite.core.reduce_spec import ReduceSpec
    from dask_hoplite.core.store import Layout, ObjectBuffer
    from dask_hoplite.worker.combine import NodeJob

    n = nbytes // 8
    spec = ReduceSpec(
        rid="r",
        op="sum",
        inputs=("a", "b", "c"),
        addresses=("tcp://w0:1", "tcp://w1:1", "tcp://w2:1"),
        parent=(None, 0, 0),
        shape=(n,),
        dtype="<f8",
        block_bytes=block,
    )
    acc = ObjectBuffer(spec.partial_key(0))
    acc.allocate(Layout({}, (nbytes,)))
    own = np.arange(n, dtype="f8")

    async def never(*_):
        raise AssertionError("no child breaks here")

    op = resolve_op("sum")
    return NodeJob(None, spec, [1, 2], op, np.dtype("f8"), own, acc, block, never)  # type: ignore[arg-type]


def test_a_combining_node_takes_a_new_operand_only_from_a_block_it_has_not_begun():
    job = _job()
    job.begun = 32  # blocks [0, 16) and [16, 32) have their inputs fixed
    assert job.first_open_byte(0) == 32 and job.first_open_byte(48) == 48
    d = np.full(8, 100.0)
    assert job.add_operand(16, d) == 32
    ones = [np.ones(2), np.ones(2)]
    for a in range(0, 64, 16):
        job.combine_block(a, a + 16, [x.copy() for x in ones])
    got = np.frombuffer(job.acc.view(0, 64), dtype="f8")
    want = np.arange(8) + 2 + np.where(np.arange(8) >= 4, 100, 0)
    assert got.tolist() == want.tolist()


def test_a_combining_node_adopts_a_child_from_a_byte_it_picks_and_refuses_when_done():
    job = _job()
    job.begun = 16
    assert job.add_child(0, ("k",), "tcp://w9:1", 5) == 16
    [child] = job.added
    assert (child.start, child.end, child.slot, child.address) == (16, 64, 5, "tcp://w9:1")
    assert job.add_child(64, ("k",), "tcp://w9:1", 6) == 64  # nothing left to add
    assert len(job.added) == 1
    job.finished = True
    assert job.add_child(0, ("k",), "tcp://w9:1", 7) is None
    assert job.add_operand(0, np.zeros(8)) is None
