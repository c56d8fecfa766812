"""The plan of a reduction submitted at once (pure: no cluster)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import plan_reduction
from dask_hoplite.core.reduce_spec import ReduceSpec

NET = NetworkEstimate(bandwidth=125e6, latency=1e-3, measured=True)
WORKERS = [f"tcp://10.0.0.{i}:1" for i in range(6)]


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
    return keys, chosen, who_has, to, size


@settings(max_examples=300, deadline=None)
@given(reductions())
def test_a_plan_reduces_exactly_the_chosen_inputs_on_the_worker_asked_for(case):
    keys, chosen, who_has, to, size = case
    spares = [k for k in keys if k not in chosen]
    plan = plan_reduction(
        "r", "sum", chosen, spares, who_has, dict.fromkeys(keys, size), NET, 2**20, 2**16, to
    )
    assert plan["chosen"] == chosen and plan["spares"] == spares
    if to is not None:
        assert plan["root"] == to  # the result is where the caller asked
    if size < 2**20:
        assert plan["mode"] == "values"
        return
    spec = ReduceSpec.from_msg(plan["spec"])
    assert sorted(spec.inputs) == sorted(chosen)
    assert spec.addresses[spec.root] == plan["root"]
    for slot, key in enumerate(spec.inputs):
        if slot != spec.root:
            assert spec.addresses[slot] in who_has[key]  # every other input streams from a holder
    holders_of_to = [key for key in chosen if to in who_has[key]]
    if to is None or holders_of_to:
        # the root's input is local to the root: nothing is fetched first
        assert plan["root"] in who_has[spec.inputs[spec.root]]


def test_an_input_without_a_holder_is_named():
    with pytest.raises(ValueError, match="'x-1' has no holder"):
        plan_reduction("r", "sum", ["x-0", "x-1"], [], {"x-0": WORKERS[:1]}, {}, NET, 0, 1)
