"""A reduce tree's shape: Hoplite's rule, the fill order, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.tree_shape import colocated_order, max_chain_length, plan_reduce_tree


def test_large_objects_give_one_chain():
    # 256 MiB at 1 Gbit/s with 750 us per hop: k ~ 2863, far more than 8 nodes.
    k = max_chain_length(256 * 2**20, 125e6, 750e-6)
    assert k == round(256 * 2**20 / (125e6 * 750e-6))
    t = plan_reduce_tree(8, k)
    assert t.depth == 0
    # A chain numbered bottom-up: node i feeds node i + 1, the root is last.
    assert t.parent == (1, 2, 3, 4, 5, 6, 7, None)
    assert t.root == 7 and t.height() == 7


def test_tiny_objects_give_a_full_binary_tree():
    t = plan_reduce_tree(7, max_chain_length(1024, 125e6, 750e-6))
    assert t.depth == 3 and t.height() == 2
    assert sorted(len(t.children(i)) for i in range(7)) == [0, 0, 0, 0, 2, 2, 2]
    # in-order numbering: 0 is the leftmost leaf, the root is in the middle
    assert t.root == 3 and t.children(0) == ()


def test_medium_objects_hang_chains_below_a_small_tree():
    t = plan_reduce_tree(15, 3)
    # d = min(ceil(log2(16 / 4)), floor(log2(16))) = 2: a 3-node tree, 4 chains of 3
    assert t.depth == 2
    assert t.height() == 1 + 3
    tree_nodes = [i for i in range(15) if len(t.children(i)) == 2]
    assert len(tree_nodes) == 3


def test_one_node_is_its_own_root():
    t = plan_reduce_tree(1, 0)
    assert t.parent == (None,) and t.root == 0 and t.height() == 0


@pytest.mark.parametrize(
    "args, match",
    [((0, 1), "at least one node"), ((3, -1), "chain_length")],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        plan_reduce_tree(*args)


def test_bad_model_parameters():
    with pytest.raises(ValueError, match="bandwidth > 0"):
        max_chain_length(10, 0, 1e-3)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), k=st.integers(0, 400))
def test_every_plan_is_a_tree_over_all_nodes(n, k):
    t = plan_reduce_tree(n, k)
    assert t.n == n
    assert t.parent.count(None) == 1
    for i in range(n):
        assert len(t.children(i)) <= 2
        for c in t.children(i):
            assert t.parent[c] == i
        assert i not in t.path_to_root(i)  # acyclic: every path ends at the root
        if i != t.root:
            assert t.path_to_root(i)[-1] == t.root
    # The first input to be ready fills a slot with nothing below it, as far
    # from the root as any (earliest inputs farthest from the root).
    assert t.children(0) == ()
    if n > 1:
        assert t.root != 0
    # Chains never exceed what the model allows by more than the rounding of
    # an even split (plus the tree levels above them).
    if t.depth > 0:
        assert t.height() <= (t.depth - 1) + -(-(n - (2**t.depth - 1)) // 2**t.depth)


def cross_edges(parent, addresses, order):
    """Tree edges whose two inputs live on different workers (NIC crossings)."""
    return sum(
        1
        for c, p in enumerate(parent)
        if p is not None and addresses[order[c]] != addresses[order[p]]
    )


def test_two_inputs_on_one_worker_are_parent_and_child():
    # a lost input recomputed next to another: 8 inputs on 7 workers
    plan = plan_reduce_tree(8, 2)
    addresses = ["w0", "w1", "w2", "w3", "w4", "w5", "w6", "w3"]
    order = colocated_order(plan.parent, addresses, root_input=0)
    assert sorted(order) == list(range(8)) and order[plan.root] == 0
    slot = {inp: s for s, inp in enumerate(order)}
    a, b = slot[3], slot[7]
    assert plan.parent[a] == b or plan.parent[b] == a
    assert cross_edges(plan.parent, addresses, order) == 6


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 12),
    workers=st.integers(1, 10),
    data=st.data(),
)
def test_colocated_order_is_a_permutation_with_no_more_crossings(n, k, workers, data):
    plan = plan_reduce_tree(n, k)
    addresses = data.draw(
        st.lists(st.sampled_from([f"w{i}" for i in range(workers)]), min_size=n, max_size=n)
    )
    root_input = data.draw(st.integers(0, n - 1))
    order = colocated_order(plan.parent, addresses, root_input)
    assert sorted(order) == list(range(n))
    assert order[plan.root] == root_input
    naive = list(range(n))
    naive[plan.root], naive[root_input] = naive[root_input], naive[plan.root]
    assert cross_edges(plan.parent, addresses, order) <= cross_edges(plan.parent, addresses, naive)
    # every worker's inputs beyond its first cost no crossing, when the tree
    # is a single chain (each node has one child)
    if all(len(plan.children(i)) <= 1 for i in range(n)):
        assert cross_edges(plan.parent, addresses, order) == len(set(addresses)) - 1


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 30), k=st.integers(1, 12), data=st.data())
def test_colocated_order_keeps_a_hosts_workers_together(n, k, data):
    """Several workers per host: a host's inputs are reduced among its own
    workers before one stream leaves its NIC (on a chain: hosts - 1 NIC
    crossings in all), and never more NIC crossings than the given order."""
    plan = plan_reduce_tree(n, k)
    pool = [f"tcp://10.0.0.{h}:{4000 + w}" for h in range(4) for w in range(3)]
    addresses = data.draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    root_input = data.draw(st.integers(0, n - 1))
    order = colocated_order(plan.parent, addresses, root_input)
    hosts = [host_of(a) for a in addresses]
    naive = list(range(n))
    naive[plan.root], naive[root_input] = naive[root_input], naive[plan.root]
    assert cross_edges(plan.parent, hosts, order) <= cross_edges(plan.parent, hosts, naive)
    if all(len(plan.children(i)) <= 1 for i in range(n)):
        assert cross_edges(plan.parent, hosts, order) == len(set(hosts)) - 1
        assert cross_edges(plan.parent, addresses, order) == len(set(addresses)) - 1


def _fill_by_scanning(children, root, root_input, addresses):
    """The placement rule of ``planner._fill`` written plainly (a scan of
    every worker for each node: too slow for 1,024 inputs on the scheduler),
    as its specification."""
    left = {}
    for i, a in enumerate(addresses):
        if i != root_input:
            left.setdefault(a, []).append(i)
    order = [-1] * len(addresses)
    order[root] = root_input
    queue = [root]
    for node in queue:
        for c in children[node]:
            addr = addresses[order[node]]
            if addr not in left:
                addr = max(
                    left, key=lambda a: (host_of(a) == host_of(addr), len(left[a]), -left[a][0])
                )
            order[c] = left[addr].pop(0)
            if not left[addr]:
                del left[addr]
            queue.append(c)
    return order


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 60), k=st.integers(1, 12), data=st.data())
def test_the_fill_places_inputs_as_its_plain_specification_does(n, k, data):
    from dask_hoplite.core.tree_shape import _fill

    plan = plan_reduce_tree(n, k)
    pool = [f"tcp://10.0.0.{h}:{4000 + w}" for h in range(5) for w in range(3)]
    addresses = data.draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n))
    root_input = data.draw(st.integers(0, n - 1))
    children = [plan.children(i) for i in range(n)]
    root = plan.root
    assert _fill(children, root, root_input, addresses) == _fill_by_scanning(
        [list(c) for c in children], root, root_input, addresses
    )
