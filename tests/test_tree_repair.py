"""The repair state machine of a running reduce tree: events in, decisions out
(pure: no cluster). The worker shell (``worker/reduce_root.py``) only carries
out what it decides; these tests drive it the way the shell does, and with
events in random orders."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import (
    BreakTree,
    CheckNode,
    Closed,
    FindHolder,
    HolderFound,
    HolderMissing,
    NodeChecked,
    NodeLost,
    Patches,
    Refuse,
    RepairAborted,
    RepairAsked,
    Replace,
    Spread,
    SpreadAnswered,
    SpreadFailed,
    Tick,
    TreeRepair,
)


def chain(n: int = 4) -> ReduceSpec:
    return ReduceSpec(
        rid="r",
        op="sum",
        inputs=tuple(f"x{i}" for i in range(n)),
        addresses=tuple(f"tcp://w{i}:1" for i in range(n)),
        parent=(*range(1, n), None),
        shape=(10,),
        dtype="<f8",
        block_bytes=8,
    )


def tree7() -> ReduceSpec:
    """A binary tree of 7 nodes, root 6: 6 <- (4, 5), 4 <- (0, 1), 5 <- (2, 3)."""
    return ReduceSpec(
        rid="t",
        op="sum",
        inputs=tuple(f"x{i}" for i in range(7)),
        addresses=tuple(f"tcp://w{i}:1" for i in range(7)),
        parent=(4, 4, 5, 5, 6, 6, None),
        shape=(1000,),
        dtype="<f8",
        block_bytes=80,
    )


def asked(r: TreeRepair, slot: int, offset: int = 40, dead: str = "") -> list:
    """A parent's request, its node found dead: the decision after the check."""
    dead = dead or r.spec.addresses[slot]
    [check] = r.handle(RepairAsked(slot, offset, dead))
    assert check == CheckNode(slot, dead)
    return r.handle(NodeChecked(slot, failure=None))


def test_a_dead_node_is_replaced_where_its_input_now_is():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    assert r.handle(NodeLost(1, 0, unreachable=True, now=100.0)) == []  # the parent will ask
    assert r.next_deadline() == 105.0
    [find] = asked(r, 1, offset=16)
    assert find == FindHolder(1, "x1", avoid="tcp://w1:1")
    assert r.next_deadline() is None  # its parent asked: no deadline while it is repaired
    assert r.handle(Tick(1000.0)) == []
    [replace] = r.handle(HolderFound(1, "tcp://w9:1", load={}))
    assert isinstance(replace, Replace)
    assert (replace.slot, replace.address, replace.offset, replace.generation) == (
        1,
        "tcp://w9:1",
        16,
        1,
    )
    spec = replace.spec
    assert spec.addresses == ("tcp://w0:1", "tcp://w9:1", "tcp://w2:1", "tcp://w3:1")
    assert spec.rid == "r" and spec.parent == chain().parent  # the same tree, streams resume
    assert r.used == 1 and not r.requests


def test_the_old_call_of_a_replaced_node_ending_changes_nothing():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    asked(r, 1)
    r.handle(HolderFound(1, "tcp://w9:1", load={}))
    assert r.handle(NodeLost(1, 0, unreachable=False, now=1.0)) == []  # generation 0: stale
    assert r.handle(NodeLost(1, 1, unreachable=False, now=1.0)) == [BreakTree((1,))]


def test_a_dead_node_nobody_asks_for_breaks_the_tree_after_the_grace():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    r.handle(NodeLost(2, 0, unreachable=True, now=100.0))
    r.handle(NodeLost(2, 0, unreachable=True, now=103.0))  # the deadline stays the first one
    assert r.handle(Tick(104.9)) == []
    assert r.handle(Tick(105.0)) == [BreakTree((2,))]


def test_a_node_that_failed_on_its_own_breaks_the_tree_at_once():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    assert r.handle(NodeLost(2, 0, unreachable=False, now=0.0)) == [BreakTree((2,))]


def test_refusals_name_the_reason():
    r = TreeRepair(chain(), budget=1, grace=5.0)

    def refusal(slot):
        [d] = r.handle(RepairAsked(slot, 0, "tcp://w:1"))
        return d.reason if isinstance(d, Refuse) else None

    assert "root" in (refusal(3) or "")
    assert "no node" in (refusal(7) or "")
    asked(r, 1)
    assert "being repaired already" in (refusal(1) or "")
    r.handle(HolderFound(1, "tcp://w9:1", load={}))
    assert "node 1 of reduction r was repaired 1 times" in (refusal(1) or "")
    assert refusal(2) is None  # the budget is per node
    r.handle(Closed())
    assert "no longer running" in (refusal(0) or "")


def test_a_node_not_known_dead_is_refused_and_may_be_asked_for_again():
    r = TreeRepair(chain(), budget=1, grace=5.0)
    r.handle(RepairAsked(1, 0, "tcp://w1:1"))
    assert r.handle(NodeChecked(1, "node 1 on tcp://w1:1 failed: boom")) == [
        Refuse(1, "node 1 on tcp://w1:1 failed: boom")
    ]
    assert r.used == 0 and not r.requests
    assert isinstance(asked(r, 1)[0], FindHolder)


def test_a_tree_that_ended_meanwhile_refuses_at_each_step():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    r.handle(RepairAsked(1, 0, "tcp://w1:1"))
    r.handle(Closed())
    [d] = r.handle(NodeChecked(1, None))
    assert isinstance(d, Refuse) and "no longer running" in d.reason
    r = TreeRepair(chain(), budget=2, grace=5.0)
    asked(r, 1)
    r.handle(Closed())
    [d] = r.handle(HolderFound(1, "tcp://w9:1", load={}))
    assert isinstance(d, Refuse) and "no longer running" in d.reason
    assert r.handle(NodeLost(2, 0, unreachable=True, now=0.0)) == []  # nothing breaks now
    assert r.handle(Tick(1e9)) == []


def test_no_holder_left_refuses_with_the_error():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    asked(r, 2)
    assert r.handle(HolderMissing(2, "ReduceInputLost: gone")) == [
        Refuse(2, "ReduceInputLost: gone")
    ]


def test_spread_mode_spreads_where_the_input_lands_on_a_node_of_the_tree():
    r = TreeRepair(tree7(), budget=2, grace=5.0, mode="spread")
    [find] = asked(r, 4, offset=800)
    # Node 0's input was recomputed on node 2's worker, which runs a node.
    [spread] = r.handle(HolderFound(4, "tcp://w2:1", load={}))
    assert isinstance(spread, Spread) and spread.holder == "tcp://w2:1"
    plan = spread.plan
    assert plan.dead == 4 and plan.merge_into == 2 and plan.offset == 800
    assert {c for c, _ in plan.adopters} == {0, 1}
    adopted_from = {c: 1600 for c, _ in plan.adopters}
    [patches] = r.handle(SpreadAnswered(4, merged_from=1200, adopted_from=adopted_from))
    assert isinstance(patches, Patches) and patches.merged_from == 1200
    assert {(p.src, p.input) for p in patches.patches} == {(2, True), (0, False), (1, False)}
    assert 4 in r.live.gone and 4 in r.spread_slots
    [d] = r.handle(RepairAsked(4, 0, "tcp://w4:1"))
    assert isinstance(d, Refuse) and "spread already" in d.reason


def test_spread_mode_replaces_where_no_spread_is_possible_until_the_tree_changed():
    r = TreeRepair(tree7(), budget=2, grace=5.0, mode="spread")
    asked(r, 4)
    # The input landed on a worker that runs no node of the tree: replace.
    [d] = r.handle(HolderFound(4, "tcp://w9:1", load={}))
    assert isinstance(d, Replace)
    r = TreeRepair(tree7(), budget=2, grace=5.0, mode="spread")
    asked(r, 4)
    r.handle(HolderFound(4, "tcp://w2:1", load={}))
    r.handle(SpreadAnswered(4, merged_from=8000, adopted_from={0: 8000, 1: 8000}))
    asked(r, 5)  # after a spread, a node started from the planned shape reads the wrong children
    [d] = r.handle(HolderFound(5, "tcp://w9:1", load={}))
    assert isinstance(d, Refuse) and "could not be spread" in d.reason


def test_a_spread_nodes_old_call_ending_late_changes_nothing():
    r = TreeRepair(tree7(), budget=2, grace=5.0, mode="spread")
    asked(r, 4)
    r.handle(HolderFound(4, "tcp://w2:1", load={}))
    r.handle(SpreadAnswered(4, merged_from=8000, adopted_from={0: 8000, 1: 8000}))
    assert r.handle(NodeLost(4, 0, unreachable=True, now=1.0)) == []
    assert r.handle(NodeLost(4, 0, unreachable=False, now=1.0)) == []
    assert r.handle(Tick(1e9)) == []


def test_a_request_that_ends_without_a_reply_lets_the_node_be_asked_for_again():
    """The parent's request is cancelled midway (or a step raises): the node
    is dead and unasked for again, so the grace deadline runs once more."""
    r = TreeRepair(chain(), budget=2, grace=5.0)
    r.handle(NodeLost(1, 0, unreachable=True, now=0.0))
    asked(r, 1)  # waiting for a holder when the request is cancelled
    assert r.handle(RepairAborted(1, now=10.0)) == []
    assert not r.requests and r.next_deadline() == 15.0
    assert r.handle(Tick(15.0)) == [BreakTree((1,))]
    [find] = asked(r, 1)  # or its parent asks again in time
    assert isinstance(find, FindHolder) and r.next_deadline() is None


def test_a_spread_the_nodes_refuse_breaks_the_tree():
    r = TreeRepair(tree7(), budget=2, grace=5.0, mode="spread")
    asked(r, 4)
    r.handle(HolderFound(4, "tcp://w2:1", load={}))
    assert r.handle(SpreadFailed(4, "NodeFailed: no")) == [Refuse(4, "NodeFailed: no")]
    assert not r.requests and 4 not in r.live.gone


# ------------------------------------------------------------- random orders

SLOTS = range(8)  # slot 7 does not exist in tree7 (6 is the root)


@st.composite
def runs(draw):
    """A repair mode and a list of steps: spontaneous events, or answers
    (in whatever outcome) to a decision still waiting for one."""
    mode = draw(st.sampled_from(["replace", "spread"]))
    steps = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("lost"), st.sampled_from(SLOTS), st.booleans()),
                st.tuples(st.just("ask"), st.sampled_from(SLOTS), st.integers(0, 8000)),
                st.tuples(st.just("tick"), st.floats(0, 100)),
                st.tuples(st.just("close")),
                st.tuples(st.just("answer"), st.integers(0, 10), st.integers(0, 4)),
            ),
            max_size=60,
        )
    )
    return mode, steps


@settings(max_examples=400, deadline=None)
@given(runs())
def test_every_request_gets_one_reply_and_repairs_stay_within_their_budget(run):
    mode, steps = run
    budget = 2
    r = TreeRepair(tree7(), budget=budget, grace=5.0, mode=mode)
    root = r.spec.root
    waiting: list = []  # decisions that wait for an observation
    replies: dict[int, int] = {}  # requests still open, by slot: how many
    generation = dict.fromkeys(range(7), 0)  # what the shell knows
    closed = False
    now = 0.0

    def take(decisions):
        nonlocal closed
        for d in decisions:
            assert not isinstance(d, (Replace, Spread)) or not closed
            if isinstance(d, (Refuse, Replace, Patches)):
                replies[d.slot] -= 1
                assert replies[d.slot] == 0, d  # one reply per request
                del replies[d.slot]
            if isinstance(d, Replace):
                assert d.slot != root and d.generation == generation[d.slot] + 1
                assert d.spec.addresses[d.slot] == d.address
                generation[d.slot] = d.generation
            if isinstance(d, BreakTree):
                assert not closed and root not in d.slots
            if isinstance(d, (CheckNode, FindHolder, Spread)):
                assert d.slot != root
                waiting.append(d)

    for step in steps:
        kind = step[0]
        if kind == "lost":
            _, slot, unreachable = step
            if slot in generation and slot != root:
                now += 1
                take(r.handle(NodeLost(slot, generation[slot], unreachable, now)))
        elif kind == "ask":
            _, slot, offset = step
            if slot in replies:
                continue  # one parent: it asks again only after its reply
            replies[slot] = 1
            take(r.handle(RepairAsked(slot, offset, f"tcp://w{slot}:1")))
        elif kind == "tick":
            now += step[1]
            take(r.handle(Tick(now)))
        elif kind == "close":
            closed = True
            take(r.handle(Closed()))
        elif waiting:
            _, which, outcome = step
            d = waiting.pop(which % len(waiting))
            if outcome == 4 and d.slot in replies:  # the request is cancelled midway
                take(r.handle(RepairAborted(d.slot, now)))
                del replies[d.slot]
                continue
            if isinstance(d, CheckNode):
                event = NodeChecked(d.slot, None if outcome else "it answered")
            elif isinstance(d, FindHolder):
                holder = f"tcp://w{outcome * 2}:1" if outcome < 3 else "tcp://new:1"
                event = (
                    HolderFound(d.slot, holder, load={}) if outcome else HolderMissing(d.slot, "x")
                )
            else:
                assert isinstance(d, Spread)
                if outcome == 0:
                    event = SpreadFailed(d.slot, "no")
                else:
                    total = 8000
                    event = SpreadAnswered(d.slot, total, {c: total for c, _ in d.plan.adopters})
            take(r.handle(event))
        assert all(n <= budget for n in r.used_by_slot.values())
        assert r.used == sum(r.used_by_slot.values())
        assert root not in r.requests and not set(r.requests) & set(r.dead)
        assert set(r.requests) == set(replies)  # a request is open until its reply
    # Answer every decision still waiting: each open request gets its reply.
    while waiting:
        d = waiting.pop()
        if isinstance(d, CheckNode):
            take(r.handle(NodeChecked(d.slot, None)))
        elif isinstance(d, FindHolder):
            take(r.handle(HolderMissing(d.slot, "x")))
        else:
            take(r.handle(SpreadFailed(d.slot, "no")))
    assert replies == {} and r.requests == {}
