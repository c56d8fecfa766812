"""Run ids (issue 41): the scheduler's reduction coordinator numbers every run
of a reduction request in order, and a run that a later one of the same tree
superseded is stale. Pure: the names and the coordinator's bookkeeping, no
cluster (the refusal on a real cluster is in ``test_collectives.py``)."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from dask_hoplite.core.reduce_spec import LatestRuns, RunName, run_name, run_rid, segment_rid
from dask_hoplite.scheduler.reduction_coordinator import ReductionCoordinator

requests = st.builds(lambda: uuid.uuid4().hex) | st.sampled_from(["twice", "a-r1", "x-s2"])
suffixes = st.sampled_from(["", "-s0", "-s12", "-3", "-0-s1"])


@given(requests, st.integers(1, 10**9), suffixes)
def test_a_run_id_names_its_request_number_and_tree(request, n, suffix):
    assert run_name(run_rid(request, n) + suffix) == RunName(request, n, suffix)
    assert run_name(run_rid(request, n) + suffix).later(n + 1) == run_rid(request, n + 1) + suffix


def test_an_id_the_coordinator_did_not_number_has_no_run():
    rid = uuid.uuid4().hex
    assert run_name(rid) is None
    assert run_name(segment_rid(rid, 2)) is None


def coordinator():
    return ReductionCoordinator(
        first_ready=None,  # type: ignore[arg-type]
        network=None,  # type: ignore[arg-type]
        task=lambda key: None,
        workers=lambda: [],
        restrict=lambda pins: None,
    )


def test_a_later_plan_of_a_request_supersedes_every_tree_of_the_earlier():
    c = coordinator()
    first, second = c.run_id("req"), c.run_id("req")
    assert first != second
    assert c.superseded(second) is None and c.superseded(segment_rid(second, 1)) is None
    assert "stale" in str(c.superseded(first))
    assert "stale" in str(c.superseded(segment_rid(first, 1)))
    assert c.superseded(c.run_id("other")) is None


def test_a_tree_restarted_alone_supersedes_only_itself():
    """A segment (or pytree leaf) restarts as a run of its own: the run's
    other trees go on under the earlier number and are not stale."""
    c = coordinator()
    run = c.run_id("req")
    seg1 = run_name(segment_rid(run, 1))
    assert seg1 is not None
    c._number(seg1.tree)  # segment 1 restarted
    assert "stale" in str(c.superseded(segment_rid(run, 1)))
    assert c.superseded(segment_rid(run, 2)) is None
    assert c.superseded(run + "-0") is None


def test_the_latest_runs_keep_the_highest_number_of_the_most_recent_trees():
    latest = LatestRuns(limit=2)
    latest.record("a", 3)
    latest.record("a", 2)  # an earlier run seen late changes nothing
    assert latest.get("a") == 3
    latest.record("b", 1)
    latest.record("a", 4)  # a is now the most recent
    latest.record("c", 5)  # b, the least recent, is forgotten
    assert (latest.get("a"), latest.get("b"), latest.get("c")) == (4, None, 5)
