"""The root's bookkeeping for replacing dead nodes of a running reduce tree."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import TreeRepair


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


def test_a_dead_node_is_replaced_where_its_input_now_is():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    assert r.refusal(1) is None
    r.node_died(1, now=100.0)
    assert r.next_deadline() == 105.0
    r.begin(1)
    assert r.next_deadline() is None  # its parent asked: no deadline while it is repaired
    assert r.unrepaired(now=1000.0) == []
    spec = r.replaced(1, "tcp://w9:1")
    assert spec.addresses == ("tcp://w0:1", "tcp://w9:1", "tcp://w2:1", "tcp://w3:1")
    assert spec.rid == "r" and spec.parent == chain().parent  # the same tree, streams resume
    assert r.used == 1 and not r.repairing


def test_a_dead_node_nobody_asks_for_breaks_the_tree_after_the_grace():
    r = TreeRepair(chain(), budget=2, grace=5.0)
    r.node_died(2, now=100.0)
    r.node_died(2, now=103.0)  # the deadline stays the first one
    assert r.unrepaired(now=104.9) == []
    assert r.unrepaired(now=105.0) == [2]


def test_refusals_name_the_reason():
    r = TreeRepair(chain(), budget=1, grace=5.0)
    assert "root" in (r.refusal(3) or "")
    assert "no node" in (r.refusal(7) or "")
    r.begin(1)
    assert "node 1 of reduction r was replaced 1 times" in (r.refusal(1) or "")
    assert r.refusal(2) is None  # the budget is per node
    r.closed = True
    assert "no longer running" in (r.refusal(1) or "")


def test_a_node_being_repaired_is_not_declared_dead_again():
    r = TreeRepair(chain(), budget=3, grace=1.0)
    r.begin(1)
    r.node_died(1, now=0.0)  # its old call ends while the replacement is prepared
    assert r.unrepaired(now=10.0) == []
    r.abandon(1)
    assert not r.repairing


@given(st.lists(st.tuples(st.integers(0, 7), st.sampled_from(["died", "begin", "done"]))))
def test_replacements_of_each_node_never_exceed_the_budget(events):
    spec = chain(8)
    r = TreeRepair(spec, budget=3, grace=1.0)
    for t, (slot, what) in enumerate(events):
        if what == "died":
            r.node_died(slot, now=float(t))
        elif what == "begin" and r.refusal(slot) is None:
            r.begin(slot)
        elif what == "done" and slot in r.repairing:
            r.replaced(slot, f"tcp://new{t}:1")
    assert all(n <= 3 for n in r.used_by_slot.values())
    assert r.used == sum(r.used_by_slot.values())
    assert spec.root not in r.repairing
    assert len(r.spec.addresses) == 8
