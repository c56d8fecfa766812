"""Split-tree broadcast plans, and the directory following them, without a
network: every part reaches every receiver, no uplink carries more than the
object once, the depth is logarithmic, and a receiver whose planned sender
died is served by the directory's own rules."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core import object_parts
from dask_hoplite.core.directory import Assign, ObjectDirectory, Queued
from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.reduce_plan import split_tree_specs
from dask_hoplite.core.split_trees import split_tree_parents, tree_depth


def addr(i: int, per_host: int = 1) -> str:
    return f"tcp://10.0.{i // per_host}.1:{4000 + i % per_host}"


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), parts=st.integers(1, 6), per_host=st.integers(1, 3))
def test_each_uplink_carries_the_object_once_and_depth_is_logarithmic(n, parts, per_host):
    source = addr(0, per_host)
    receivers = [addr(i, per_host) for i in range(1, n + 1)]
    plans = split_tree_parents(source, receivers, parts)
    assert len(plans) == parts
    nic_streams: Counter[str] = Counter()  # streams of one part leaving a host
    for plan in plans:
        assert set(plan) == set(receivers) - {source}
        for r, s in plan.items():
            if host_of(r) != host_of(s):
                nic_streams[host_of(s)] += 1
        hosts = len({host_of(r) for r in receivers} - {host_of(source)})
        if hosts and parts > 1:
            local_hop = per_host > 1
            assert tree_depth(plan, source) <= 2 + local_hop + math.ceil(math.log(hosts, parts))
        if hosts and parts == 1:
            assert tree_depth(plan, source) <= hosts + (per_host > 1)  # a chain
    # parts streams of S/parts each: at most S out of any NIC, the source's
    # exactly S (each part once), and each part enters each host once.
    assert all(c <= parts for c in nic_streams.values())
    if len({host_of(r) for r in receivers} - {host_of(source)}):
        assert nic_streams[host_of(source)] == parts
    into_hosts = Counter(
        (j, host_of(r))
        for j, plan in enumerate(plans)
        for r, s in plan.items()
        if host_of(r) != host_of(s)
    )
    assert set(into_hosts.values()) <= {1}


def test_two_parts_over_seven_receivers():
    plans = split_tree_parents("s", [f"r{i}" for i in range(7)], 2)
    # Part 0: r0, r1, r2 send two streams each; part 1: r3, r4, r5; r6 none.
    assert plans[0] == {
        "r0": "s",
        "r1": "r0",
        "r2": "r0",
        "r3": "r1",
        "r4": "r1",
        "r5": "r2",
        "r6": "r2",
    }
    assert plans[1] == {
        "r3": "s",
        "r4": "r3",
        "r5": "r3",
        "r0": "r4",
        "r1": "r4",
        "r2": "r5",
        "r6": "r5",
    }


def test_workers_of_one_host_take_every_part_from_its_first():
    w = ["tcp://10.0.0.2:1", "tcp://10.0.0.2:2", "tcp://10.0.0.1:2", "tcp://10.0.0.3:1"]
    for plan in split_tree_parents("tcp://10.0.0.1:1", w, 2):
        assert plan["tcp://10.0.0.2:2"] == "tcp://10.0.0.2:1"
        assert plan["tcp://10.0.0.1:2"] == "tcp://10.0.0.1:1"


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="parts must be >= 1"):
        split_tree_parents("s", ["a"], 0)
    with pytest.raises(ValueError, match="distinct"):
        split_tree_parents("s", ["a", "a"], 2)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(2, 40),
    parts=st.integers(1, 4),
    data=st.data(),
)
def test_the_directory_follows_the_plan_in_any_arrival_order(n, parts, data):
    receivers = [addr(i) for i in range(1, n + 1)]
    source = addr(0)
    keys = [f"part-{j}" for j in range(parts)]
    d = ObjectDirectory(fanout=1)
    d.plan_split(keys, receivers)
    plans = split_tree_parents(source, receivers, parts)
    order = data.draw(st.permutations([(k, r) for k in keys for r in receivers]))
    dead = data.draw(st.sets(st.sampled_from(receivers), max_size=n // 4))
    kill_at = data.draw(st.integers(0, len(order)))
    assigned: dict[tuple[str, str], str] = {}

    def take(decisions) -> None:
        for dec in decisions:
            if isinstance(dec, Assign):
                assert (dec.key, dec.receiver) not in assigned
                assigned[(dec.key, dec.receiver)] = dec.sender

    for i, (key, r) in enumerate(order):
        if i == kill_at:
            for w in dead:
                take(d.worker_removed(w))
                for k in keys:
                    assigned.pop((k, w), None)
        if i >= kill_at and r in dead:
            continue
        dec = d.request(key, r, holders=[source])
        assert isinstance(dec, (Assign, Queued))
        take([dec])
        take(d.drain(key))
    if kill_at >= len(order):
        dead = set()
    alive = [r for r in receivers if r not in dead]
    # Without failures every part streams as planned, before any completes.
    for j, key in enumerate(keys):
        for r in receivers if not dead else ():
            assert assigned[(key, r)] == plans[j][r]
        for r in d.objects[key].incoming:
            assert r not in d.upstream(key, r)
    # Receivers whose sender died ask again, excluding it; then the streams
    # complete, nearest the source first, until every live receiver has it.
    for (key, r), sender in list(assigned.items()):
        if sender in dead:
            del assigned[(key, r)]
            take([d.request(key, r, holders=[source], exclude=[sender])])
    done: set[tuple[str, str]] = set()
    for _ in range(4 * n * parts):
        ready = [t for t in d.transfers.values() if (t.key, t.sender) in done or t.depth == 1]
        if not ready:
            break
        t = min(ready, key=lambda t: t.transfer_id)
        done.add((t.key, t.receiver))
        take(d.transfer_finished(t.transfer_id, ok=True))
    assert done == {(k, r) for k in keys for r in alive}


def test_a_receiver_waits_for_its_planned_sender_then_streams_from_it():
    d = ObjectDirectory(fanout=1)
    d.plan_split(["p0", "p1"], ["a", "b", "c"])
    # Part 0's tree: s -> a -> {b, c}.
    plan = split_tree_parents("s", ["a", "b", "c"], 2)[0]
    assert plan == {"a": "s", "b": "a", "c": "a"}
    assert d.request("p0", "c", holders=["s"]) == Queued("p0", "c")
    a = d.request("p0", "a", holders=["s"])
    assert isinstance(a, Assign) and a.sender == "s"
    [c] = d.drain("p0")
    assert isinstance(c, Assign) and (c.receiver, c.sender) == ("c", "a")
    # a dies: b, planned below a, is served by the directory's own rules.
    d.worker_removed("a")
    b = d.request("p0", "b", holders=["s"])
    assert isinstance(b, Assign) and b.sender == "s"


def test_two_receivers_waiting_on_each_other_are_released_by_unplan():
    # a fetches part 1 first and c part 0 first, one part at a time: each
    # waits for the other's request of the part it is not fetching yet.
    d = ObjectDirectory(fanout=1)
    d.plan_split(["p0", "p1"], ["a", "b", "c", "d"])
    plans = split_tree_parents("s", ["a", "b", "c", "d"], 2)
    assert plans[0]["c"] == "a" and plans[1]["a"] == "c"
    assert d.request("p1", "a", holders=["s"]) == Queued("p1", "a")
    assert d.request("p0", "c", holders=["s"]) == Queued("p0", "c")
    assert d.waits_for_plan("p1", "a") and d.waits_for_plan("p0", "c")
    # The service gives up waiting for the plan after hoplite.broadcast.plan-wait.
    [got] = d.unplan("p1", "a")
    assert isinstance(got, Assign) and (got.receiver, got.sender) == ("a", "s")
    assert not d.waits_for_plan("p1", "a") and d.unplan("p1", "a") == []


@pytest.mark.parametrize(
    "obj",
    [
        np.arange(100_003, dtype="f8").reshape(-1, 1),
        np.asfortranarray(np.arange(600, dtype="i2").reshape(20, 30)),
        np.arange(10)[::3],
        np.zeros(0),
        np.array(["a", None, 3], dtype=object),
        {"payload": b"x" * 1000, "n": 3},
    ],
)
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_an_object_cut_into_parts_joins_back_identical(obj, parts):
    flat = object_parts.flatten(obj)
    cut = [object_parts.part_of(flat, j, parts) for j in range(parts)]
    assert sum(len(c) for c in cut) == len(flat)
    got = object_parts.join_parts(object_parts.meta_of(obj), *cut)
    if isinstance(obj, np.ndarray):
        assert got.shape == obj.shape and got.dtype == obj.dtype
        np.testing.assert_array_equal(got, obj)
    else:
        assert got == obj


def test_a_contiguous_array_is_cut_without_a_copy():
    x = np.arange(1000, dtype="f4")
    part = object_parts.part_of(object_parts.flatten(x), 1, 4)
    assert np.shares_memory(part, x) and len(part) == 250
    with pytest.raises(ValueError, match="part 4 is not in range"):
        object_parts.part_of(x, 4, 4)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(3, 120), parts=st.integers(2, 5), dup=st.integers(0, 3), data=st.data())
def test_split_reduce_trees_receive_and_send_the_object_once_per_host(n, parts, dup, data):
    workers = [addr(i) for i in range(n)]
    # Inputs by slot: one per worker, and ``dup`` more on random workers.
    addresses = workers + [data.draw(st.sampled_from(workers)) for _ in range(dup)]
    root_input = data.draw(st.integers(0, len(addresses) - 1))
    keys = [f"k{i}" for i in range(len(addresses))]
    specs = split_tree_specs("r", "sum", keys, addresses, root_input, parts, 1024)
    assert [s.segment for s in specs] == [(j, parts) for j in range(parts)]
    # Each tree has its own id; all name the one reduction they make up.
    assert len({s.rid for s in specs}) == parts
    assert {s.reduction_rid for s in specs} == {"r"}
    down: Counter[str] = Counter()  # segment streams into each host
    up: Counter[str] = Counter()
    for spec in specs:
        assert spec.root == root_input and spec.inputs == tuple(keys)
        for slot, p in enumerate(spec.parent):
            if p is None:
                continue
            walk, seen = p, {slot}
            while walk is not None:  # every node reaches the root
                assert walk not in seen
                seen.add(walk)
                walk = spec.parent[walk]
            src, dst = host_of(addresses[slot]), host_of(addresses[p])
            if src != dst:
                up[src] += 1
                down[dst] += 1
    assert all(c <= parts for c in down.values())
    assert all(c <= parts for c in up.values())
