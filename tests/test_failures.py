"""Workers killed in the middle of a collective, on an emulated cluster (real
processes, real rate-limited network, SIGKILL): broadcasts resume from the
byte they reached, a lost source is recomputed and its partial copies
resume, a reduction (whole or in parts) replaces a dead participant inside
its running tree(s), or (a reduce in parts, by default) spreads it over
the live nodes. Needs root and iproute2 (CI has both); skipped
elsewhere."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import emulation  # noqa: E402
from benchmarks.failure import run_one  # noqa: E402

ok, why = emulation.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not ok, reason=why or "")]

SIZE = 48 * 2**20  # 2 s per full copy at 200 Mbit/s
ENV = {"DASK_HOPLITE__STALL_TIMEOUT": "5s"}


@pytest.fixture(scope="module")
def ec():
    with emulation.EmulatedCluster(4, rate_mbit=200) as cluster:
        yield cluster


@pytest.mark.timeout(300)
def test_receivers_below_a_dead_relay_resume_from_the_byte_they_reached(ec):
    o = run_one(ec, "broadcast-relay", "hoplite", SIZE, kill=True, env=ENV)
    assert o.ok, o
    assert o.resumes >= 1 and o.restarts == 0, o
    # resumed, not restarted: the receivers kept the bytes they had
    assert o.bytes_resumed > 0, o
    assert "resumes" in o.events, o  # client.get_events("hoplite") tells the story


@pytest.mark.timeout(300)
def test_a_range_whose_relay_died_resumes_from_the_byte_it_reached(ec):
    """A key split into byte ranges (forced: 2, on 4 hosts) loses an inner
    node of a range's tree: the receivers below it resume that range from
    another holder, the others stream on; nothing restarts."""
    env = {**ENV, "DASK_HOPLITE__BROADCAST__RANGES": "2"}
    o = run_one(ec, "broadcast-ranges", "hoplite", SIZE, kill=True, env=env)
    assert o.ok, o
    assert o.ranged >= 2, o  # the survivors below w1 received x in ranges
    assert o.resumes >= 1 and o.restarts == 0, o
    assert o.bytes_resumed > 0, o


@pytest.mark.timeout(300)
def test_a_lost_source_is_recomputed_and_partial_copies_resume(ec):
    o = run_one(ec, "broadcast-source", "hoplite", SIZE, kill=True, env=ENV)
    assert o.ok, o
    # The recomputed object is the same: no receiver restarted from byte 0;
    # each resumed from the byte it reached or never broke off.
    assert o.restarts == 0, o
    # Every survivor was receiving, so the recomputation ran on one of them,
    # and its partial copy, which may feed relays, was completed from it
    # rather than dropped under them.
    assert o.adopted == 1, o


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "scenario, trees, repair",
    [
        # one tree replaces its dead nodes by default (hoplite.reduce.repair: auto)
        ("reduce", 1, None),
        # parts=2 on 4 hosts: the dead worker is an inner node of one
        # segment's tree and a leaf of the other; each tree replaces it.
        ("reduce-parts", 2, "replace"),
    ],
)
def test_a_reduction_survives_a_dead_participant(ec, scenario, trees, repair):
    env = dict(ENV) if repair is None else {**ENV, "DASK_HOPLITE__REDUCE__REPAIR": repair}
    o = run_one(ec, scenario, "hoplite", SIZE, kill=True, env=env)
    assert o.ok, o
    # the dead node was replaced inside each running tree; none restarted
    assert o.tree_repairs == trees and o.tree_restarts == 0, o
    assert {"reduce-children-replaced", "reduce-repaired"} <= set(o.events), o
    assert "reduce-spread" not in o.events, o


@pytest.mark.timeout(300)
def test_a_reduction_in_parts_spreads_a_dead_participant_over_the_live_nodes(ec):
    """By default (hoplite.reduce.repair: auto) a reduce in parts spreads a
    dead node: in each segment's tree its input joins the stream of the
    worker that recomputed it, its children (in the tree where it has some)
    go to other inner nodes, and its parent reads the blocks in between as
    patches. The result is exact (checked by run_one) and no tree restarts."""
    assert "DASK_HOPLITE__REDUCE__REPAIR" not in ENV
    o = run_one(ec, "reduce-parts", "hoplite", SIZE, kill=True, env=ENV)
    assert o.ok, o
    assert o.tree_repairs == 2 and o.tree_restarts == 0, o
    assert {"reduce-spread", "reduce-children-spread", "reduce-repaired"} <= set(o.events), o
    assert "reduce-children-replaced" not in o.events, o


@pytest.mark.timeout(300)
def test_retiring_a_relay_mid_broadcast_loses_nothing_and_does_not_restart(ec):
    o = run_one(ec, "broadcast-retire", "hoplite", SIZE, kill=True, env=ENV)
    assert o.ok, o  # every consumer, the retired worker's included (run elsewhere)
    assert o.resumes >= 1 and o.restarts == 0, o
    assert o.bytes_resumed > 0, o  # the cut receivers kept the bytes they had
    # The retired worker stops its own stream at once: it does not keep
    # taking its sender's upload (from the others) to the object's end. (On
    # Python 3.10 asyncio.wait_for may swallow that cancellation: gh-86296.)
    if sys.version_info >= (3, 11):
        assert o.victim_rx_bytes < 0.8 * SIZE, o


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_participant_killed_again_and_again_on_one_cluster_never_costs_a_wrong_result(ec):
    """Warm failures (``benchmarks/failure.py --warm``): the same reduce
    participant killed twice on one cluster, restarted in between (it joins
    again, the plugin with it); a failure-free reduction before each kill.
    Every result is right and each kill is timed."""
    from benchmarks.failure_warm import run_warm

    r = run_warm(ec, "reduce", "hoplite", SIZE, kills=2, victim="w1", env=ENV)
    assert r.ok, r
    assert len(r.kills) == 2 and all(k.killed > 0 and k.free > 0 for k in r.kills), r
