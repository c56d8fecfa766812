"""Spares: with ``k < n``, an input lost with its worker while its tree runs
is replaced by a ready spare, and ``reduced_inputs`` says so.

The choice (:func:`~dask_hoplite.core.reduce_spec.with_spares`) and the
scheduler's record (:class:`~dask_hoplite.scheduler.spares_used.SparesUsed`)
are tested alone; then a worker process holding a chosen input is killed in
the middle of a tree, and the result holds the spare.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from conftest import process_workers
from distributed import wait
from hypothesis import given
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite.collectives.futures import INPUTS_ATTR
from dask_hoplite.compat import worker_addresses
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import PlanRequest, Tree, plan_reduction
from dask_hoplite.core.reduce_spec import ReduceSpec, with_spares
from dask_hoplite.scheduler.spares_used import SparesUsed


def spec(inputs, spares, root=0, **kw):
    n = len(inputs)
    parent = tuple(None if i == root else root for i in range(n))
    return ReduceSpec(
        rid="r",
        op="sum",
        inputs=tuple(inputs),
        addresses=tuple(f"w{i}" for i in range(n)),
        parent=parent,
        shape=(),
        dtype="",
        block_bytes=1,
        spares=tuple(spares),
        **kw,
    )


def test_a_lost_input_takes_the_first_ready_spare():
    s = spec(["a", "b", "c"], ["d", "e"])
    holders = {"a": ["w0"], "b": ["w1"], "c": ["w2"], "d": [], "e": ["w4"]}
    new, swaps = with_spares(s, holders, avoid={"w1"})  # w1 died: b is lost, d is not ready
    assert swaps == {"b": "e"}
    assert new.inputs == ("a", "e", "c") and new.spares == ("d",)
    assert new.addresses == s.addresses and new.parent == s.parent  # placed again later


def test_nothing_changes_without_a_ready_spare_or_a_lost_input():
    s = spec(["a", "b"], ["c"])
    assert with_spares(s, {"a": ["w0"], "b": ["w1"], "c": ["w2"]}, set()) == (s, {})
    assert with_spares(s, {"a": ["w0"], "b": [], "c": []}, set()) == (s, {})
    # the root's input is the root's own: never replaced
    assert with_spares(s, {"a": [], "b": ["w1"], "c": ["w2"]}, set()) == (s, {})


def test_segment_trees_and_allreduces_keep_their_inputs():
    """The segments of one result must all reduce the same inputs; an
    allreduce has no spares (k = n) and its own fallback."""
    holders = {"a": ["w0"], "b": [], "c": ["w2"]}
    segment = spec(["a", "b"], ["c"], segment=(0, 2))
    assert with_spares(segment, holders, set()) == (segment, {})
    allreduce = spec(["a", "b"], ["c"], copies=("w2",))
    assert with_spares(allreduce, holders, set()) == (allreduce, {})


@given(
    lost=st.lists(st.booleans(), min_size=1, max_size=8),
    ready=st.lists(st.booleans(), max_size=8),
)
def test_every_lost_input_takes_a_distinct_spare_while_there_are_ready_ones(lost, ready):
    inputs = [f"x{i}" for i in range(len(lost))]
    spares = [f"s{i}" for i in range(len(ready))]
    holders = {k: [] if gone else ["w"] for k, gone in zip(inputs, lost, strict=True)}
    holders |= {k: ["w"] if ok else [] for k, ok in zip(spares, ready, strict=True)}
    new, swaps = with_spares(spec(inputs, spares), holders, set())
    replaceable = sum(lost[1:])  # slot 0 is the root's
    assert len(swaps) == min(replaceable, sum(ready))
    assert len(set(new.inputs)) == len(inputs)  # no spare twice
    assert set(swaps.values()) <= {k for k, ok in zip(spares, ready, strict=True) if ok}
    assert set(new.spares) == set(spares) - set(swaps.values())
    assert new.inputs[0] == inputs[0]


def test_a_tree_plan_carries_its_spares():
    keys = ["a", "b", "c", "d"]
    req = PlanRequest("r", "sum", tuple(keys), k=3, min_bytes=0, block_bytes=2**20)
    who_has = {k: [f"tcp://h{i}:1"] for i, k in enumerate(keys)}
    net = NetworkEstimate(bandwidth=125e6, latency=1e-3, measured=True)
    plan = plan_reduction(req, keys[:3], who_has, dict.fromkeys(keys, 2**20), net)
    assert isinstance(plan, Tree) and plan.spec.spares == ("d",)
    assert ReduceSpec.from_msg(plan.spec.to_msg()) == plan.spec


def test_the_scheduler_keeps_what_replaced_what_while_the_result_lives():
    used = SparesUsed()
    assert used.reduced_inputs("res") == []
    used.used("res", [[["x", 1], ["x", 3]]])  # tuple keys arrive as lists
    assert used.reduced_inputs("res") == [[("x", 1), ("x", 3)]]
    used.key_transitioned("res", "released")
    assert used.reduced_inputs("res") == [[("x", 1), ("x", 3)]]
    used.key_transitioned("res", "forgotten")
    assert used.reduced_inputs("res") == []


def _partials(dask_worker):
    from dask_hoplite.core.reduce_spec import is_partial_key

    return [k for k in dask_worker.plugins["hoplite-worker"].store.buffers if is_partial_key(k)]


@pytest.mark.slow
def test_a_participant_killed_mid_tree_is_replaced_by_a_ready_spare():
    """k = 3 of 4 inputs, each on its own worker process; the three first
    ready are chosen and the fourth is ready too. Once the plan is made, the
    worker holding a chosen input (not the root's) is stopped, so that its
    node cannot finish; once the root holds a partial result, it is killed:
    that input was scattered, so no copy of it is left and Dask cannot
    compute it again. The tree restarts with the spare in its place: the
    result is the sum of the inputs reduced_inputs names, which holds the
    spare and not the lost input, also while the worker that replaces the
    dead one is still registering."""
    with process_workers(4) as (cluster, c):
        ws = worker_addresses(c)
        n = 2**25  # 256 MiB of float64 per input
        values = {}
        chosen = []
        for i, w in enumerate(ws[:3]):
            [f] = c.scatter([np.full(n, float(i + 1))], workers=[w], hash=False)
            chosen.append(f)
            values[f.key] = float(i + 1)
        wait(chosen)
        spare = c.submit(np.full, n, 10.0, workers=[ws[3]], pure=False)
        wait(spare)
        values[spare.key] = 10.0
        victim = chosen[2]  # on ws[2], a node of the tree, not its root
        pid = c.run(os.getpid, workers=[ws[2]])[ws[2]]
        total = dh.reduce([*chosen, spare], "sum", k=3, to=ws[0], parts=1)
        plan = getattr(total, INPUTS_ATTR).result()
        # Frozen before its 256 MiB can have reached its parent (the plan
        # only just finished): its node stays unfinished until it dies.
        os.kill(pid, signal.SIGSTOP)
        assert list(plan["spares"]) == [spare.key], plan["chosen"]
        t0 = time.monotonic()
        while not c.run(_partials, workers=[ws[0]])[ws[0]]:
            assert time.monotonic() - t0 < 60 and not total.done()
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        result = total.result(timeout=120)
        used = dh.reduced_inputs(total)
        assert spare.key in used and victim.key not in used and len(used) == 3
        expected = sum(values[k] for k in used)  # 1 + 2 + 10
        assert result[0] == expected and result[-1] == expected and expected == 13.0
        events = [e for _, e in c.get_events("hoplite") if e.get("action") == "reduce-spares"]
        assert events and events[-1]["lost"] == victim.key, events
