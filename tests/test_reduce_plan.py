"""Every reduction's plan, from the one planner (pure: no cluster), and the
paths that ask it (a real in-process cluster)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_array import spread, taken_over

import dask_hoplite as dh
from dask_hoplite.core.allreduce_outputs import output_roles, output_workers
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import (
    AllreduceTree,
    OneTask,
    PlanRequest,
    SegmentedAllreduce,
    SplitTrees,
    Tree,
    is_small,
    plan_from_msg,
    plan_reduction,
    plan_without_hoplite,
    relocated_spec,
)
from dask_hoplite.errors import ReduceInputLost

NET = NetworkEstimate(bandwidth=125e6, latency=1e-3, measured=True)
WORKERS = [f"tcp://10.0.0.{i}:1" for i in range(6)]
MIN = 2**20


def request(keys, k=None, **kw):
    return PlanRequest(
        rid="r",
        op="sum",
        inputs=tuple(keys),
        k=k or len(keys),
        min_bytes=MIN,
        block_bytes=2**16,
        **kw,
    )


@st.composite
def reductions(draw):
    n = draw(st.integers(1, 10))
    keys = [f"x-{i}" for i in range(n)]
    who_has = {
        k: draw(st.lists(st.sampled_from(WORKERS), min_size=1, max_size=3, unique=True))
        for k in keys
    }
    k = draw(st.integers(1, n))
    chosen = draw(st.permutations(keys))[:k]
    to = draw(st.one_of(st.none(), st.sampled_from(WORKERS)))
    size = draw(st.sampled_from([10, 2**20, 256 * 2**20]))
    parts = draw(st.sampled_from([1, 4]))
    allreduce = draw(st.booleans())
    return keys, chosen, who_has, to, size, parts, allreduce


@settings(max_examples=300, deadline=None)
@given(reductions())
def test_a_plan_reduces_exactly_the_chosen_inputs_on_the_worker_asked_for(case):
    keys, chosen, who_has, to, size, parts, allreduce = case
    to = None if allreduce else to
    req = request(keys, len(chosen), to=to, parts=parts, allreduce=allreduce)
    plan = plan_reduction(req, chosen, who_has, dict.fromkeys(keys, size), NET)
    spares = [k for k in keys if k not in chosen]
    assert list(plan.chosen) == chosen and list(plan.spares) == spares
    assert plan_from_msg(plan.to_msg()) == plan
    if to is not None:
        assert plan.root == to  # the result is where the caller asked
    if is_small(size, MIN):
        assert isinstance(plan, OneTask)
        if allreduce:  # every other input's worker pulls the one task's result
            workers = output_workers(chosen, who_has)
            first = {w: workers.index(w) for w in workers}
            for i, (w, role) in enumerate(zip(workers, output_roles(plan, workers), strict=True)):
                if first[w] != i:
                    assert role == ["alias", first[w]]
                else:
                    assert role == (["reduce"] if w == plan.root else ["pull", first[plan.root]])
        return
    specs = list(plan.specs) if isinstance(plan, (SplitTrees, SegmentedAllreduce)) else [plan.spec]
    kinds = (SegmentedAllreduce, AllreduceTree, Tree) if allreduce else (Tree, SplitTrees)
    assert isinstance(plan, kinds)
    if isinstance(plan, AllreduceTree):  # the result is copied to every other input's worker
        copies = set(plan.spec.copies)
        assert copies and copies | {plan.root} == set(plan.spec.addresses)
    if isinstance(plan, SegmentedAllreduce):
        # one segment rooted on each worker, at an input it holds; the others copy it
        workers = list(dict.fromkeys(plan.specs[0].addresses))
        assert plan.workers == workers and len(plan.specs) == len(workers)
        for i, (spec, slot) in enumerate(zip(plan.specs, plan.roots, strict=True)):
            assert spec.root == slot and spec.segment == (i, len(workers))
            assert spec.addresses[slot] == workers[i]
            assert set(spec.copies) == set(workers) - {workers[i]}
    for spec in specs:
        assert sorted(spec.inputs) == sorted(chosen)
        for slot, key in enumerate(spec.inputs):
            if spec.addresses[slot] != to:
                assert spec.addresses[slot] in who_has[key]  # inputs stream from a holder
    if isinstance(plan, Tree):
        spec = plan.spec
        assert spec.addresses[spec.root] == plan.root
        if to is None or any(to in who_has[key] for key in chosen):
            # the root's input is local to the root: nothing is fetched first
            assert plan.root in who_has[spec.inputs[spec.root]]


def test_an_input_without_a_holder_is_named():
    with pytest.raises(ReduceInputLost, match="'x-1' of the reduction has no holder"):
        plan_reduction(request(["x-0", "x-1"]), ["x-0", "x-1"], {"x-0": WORKERS[:1]}, {}, NET)


def test_the_shape_follows_the_size_the_workers_and_the_call():
    keys = [f"x-{i}" for i in range(4)]
    who_has = {k: [WORKERS[i]] for i, k in enumerate(keys)}
    big, small = dict.fromkeys(keys, 64 * MIN), dict.fromkeys(keys, 10)

    def plan(nbytes, net=NET, **kw):
        return plan_reduction(request(keys, **kw), keys, who_has, nbytes, net)

    assert isinstance(plan(small), OneTask)
    assert isinstance(plan(big), Tree)
    assert isinstance(plan(big, parts=4), SplitTrees) and len(plan(big, parts=4).specs) == 4
    assert isinstance(plan(big, allreduce=True), SegmentedAllreduce)
    assert isinstance(plan(big, allreduce=True, segment_min_bytes=2**40), AllreduceTree)
    # dask-hoplite not on the cluster
    alone = plan_without_hoplite(request(keys, allreduce=True), keys, who_has)
    assert isinstance(alone, OneTask) and alone.worker == WORKERS[0]


def test_dict_inputs_are_reduced_leaf_by_leaf():
    keys = ["a", "b", "c"]
    who_has = {k: [WORKERS[i]] for i, k in enumerate(keys)}
    plan = plan_reduction(
        request(keys, leaves=("s", "n")), keys, who_has, dict.fromkeys(keys, MIN), NET
    )
    assert isinstance(plan, Tree)
    specs = plan.leaf_specs()
    assert [s.field for s in specs] == ["s", "n"] and len({s.rid for s in specs}) == 2
    assert {s.parent for s in specs} == {plan.spec.parent}
    assert plan_from_msg(plan.to_msg()) == plan


def test_a_message_of_no_plan_is_refused():
    with pytest.raises(ValueError, match="not a reduction plan"):
        plan_from_msg({"type": "shuffle"})
    with pytest.raises(ValueError, match="a 'one-task' plan message without 'worker'"):
        plan_from_msg({"type": "one-task", "rid": "r", "op": "sum", "chosen": [], "spares": []})


def test_every_path_gets_its_plan_from_the_planner(cluster_client, caplog):
    """reduce (a tree, and small objects in one task), allreduce and a
    dask.array aggregate: each is planned by ``plan_reduction``, which says
    so in its debug log."""
    c = cluster_client
    caplog.set_level(logging.DEBUG, logger="dask_hoplite.core.reduce_plan")
    workers = sorted(c.scheduler_info()["workers"])
    big = [  # 32 KiB each, one per worker
        c.submit(np.full, 4096, float(i), workers=[w], pure=False) for i, w in enumerate(workers)
    ]
    small = [c.submit(np.full, 4, float(i), pure=False) for i in range(3)]
    assert dh.reduce(big).result().tolist() == [3.0] * 4096
    assert dh.reduce(small).result().tolist() == [3.0] * 4
    assert all(f.result().tolist() == [3.0] * 4096 for f in dh.allreduce(big))
    before = taken_over(c)
    x = spread(c, [np.full(4096, float(i)) for i in range(6)])  # parts on several workers
    assert x.sum(axis=0).compute().tolist() == [15.0] * 4096
    assert taken_over(c) == before + 1  # the aggregate ran as a reduce tree
    planned = [r.getMessage() for r in caplog.records if r.name.endswith("reduce_plan")]
    kinds = [m.split(": ")[1].split(" of")[0] for m in planned]
    assert kinds.count("one-task") == 1, planned
    assert kinds.count("tree") == 2, planned  # reduce, and the array's aggregate
    assert kinds.count("allreduce-tree") + kinds.count("segmented-allreduce") == 1, planned


def test_the_input_in_hand_is_the_roots_and_its_key_stays_where_it_is_held():
    """An allreduce's fallback reduces anew with the value it has in hand at
    the root, on its own worker: other inputs of the same key stay on their
    holders (the root's worker may only have fetched that value)."""
    keys = ["a", "b", "a"]
    who_has = {"a": [WORKERS[0]], "b": [WORKERS[1]]}
    req = request(keys, to=WORKERS[5], root_input=0)
    plan = plan_reduction(req, keys, who_has, dict.fromkeys(keys, 64 * MIN), NET)
    assert isinstance(plan, Tree) and plan.root == WORKERS[5]
    spec = plan.spec
    assert spec.inputs[spec.root] == "a"
    assert sorted(spec.addresses) == sorted([WORKERS[5], WORKERS[0], WORKERS[1]])


def test_a_restarted_tree_is_placed_where_its_inputs_are_now():
    keys = [f"x-{i}" for i in range(4)]
    who_has = {k: [WORKERS[i]] for i, k in enumerate(keys)}
    [spec] = plan_reduction(
        request(keys), keys, who_has, dict.fromkeys(keys, 64 * MIN), NET
    ).leaf_specs()
    root_key = spec.inputs[spec.root]
    lost = next(k for k in keys if k != root_key)
    keeper = next(k for k in keys if k not in (root_key, lost))
    # The lost input was recomputed on the worker of another input; its old
    # worker is gone, and a third worker holds a copy but just failed.
    now = {k: [spec.addresses[spec.inputs.index(k)]] for k in keys}
    now[lost] = [WORKERS[5], who_has[keeper][0]]
    new = relocated_spec(spec, now, {WORKERS[5]}, "tcp://root:1", "r2")
    assert new.rid == "r2" and sorted(new.inputs) == sorted(keys)
    assert new.parent == spec.parent and new.inputs[new.root] == root_key
    assert new.addresses[new.root] == "tcp://root:1"
    where = dict(zip(new.inputs, new.addresses, strict=True))
    assert where[lost] == where[keeper] == who_has[keeper][0]
    # The two inputs of one worker are neighbours: one combines into the other.
    a, b = new.inputs.index(lost), new.inputs.index(keeper)
    assert new.parent[a] == b or new.parent[b] == a
    segment = relocated_spec(
        dataclasses.replace(spec, segment=(1, 3)), now, set(), "tcp://root:1", "r3"
    )
    assert segment.rid.startswith("r3") and segment.rid != "r3"


@settings(max_examples=300, deadline=None)
@given(reductions(), st.booleans())
def test_an_allreduce_has_one_output_per_input_and_one_part_per_worker(case, hoplite):
    """Output i is made on input i's worker; the first output on each worker
    runs that worker's part of the plan (each part once), every other one
    takes the value of the first on its worker, and a small allreduce's
    outputs away from the reducing worker pull from it."""
    from dask_hoplite.core.allreduce_outputs import output_keys, output_roles, output_workers

    keys, _, who_has, _, size, _, _ = case
    inputs = keys + keys[:2]  # an input given twice is two outputs
    req = request(inputs, allreduce=True)
    plan = (
        plan_reduction(req, inputs, who_has, dict.fromkeys(keys, size), NET)
        if hoplite
        else plan_without_hoplite(req, inputs, who_has)
    )
    workers = output_workers(inputs, who_has)
    roles = output_roles(plan, workers)
    assert len(roles) == len(output_keys(req)) == len(inputs)
    assert workers == [sorted(who_has[k])[0] for k in inputs]
    first = {}
    for i, w in enumerate(workers):
        first.setdefault(w, i)
    parts = [tuple(roles[i]) for i in first.values() if roles[i][0] != "pull"]
    assert len(set(parts)) == len(parts)  # each part once (many may pull one result)
    for i, (w, role) in enumerate(zip(workers, roles, strict=True)):
        if first[w] != i:
            assert role == ["alias", first[w]]
        elif isinstance(plan, OneTask):
            assert role == (["reduce"] if w == plan.worker else ["pull", first[plan.worker]])
        elif isinstance(plan, (Tree, AllreduceTree)):
            assert role[0] == ("root" if w == plan.root else "copy")
        else:
            assert role == ["part", plan.workers.index(w)]
