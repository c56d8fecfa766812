"""Which repair a running reduce tree uses (``hoplite.reduce.repair``), as the
root's worker builds it: a real worker with the plugin, a tree root per spec."""

from __future__ import annotations

import pytest
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import Refuse, RepairAsked
from dask_hoplite.worker.reduce_root import TreeRoot


def _spec(segment=None, copies=()):
    return ReduceSpec(
        rid="r",
        op="sum",
        inputs=("a", "b", "c"),
        addresses=("tcp://w0", "tcp://w1", "tcp://w2"),
        parent=(None, 0, 1),
        shape=(1024,),
        dtype="float64",
        block_bytes=4096,
        copies=copies,
        segment=segment,
    )


@pytest.mark.parametrize(
    "repair, segment, copies, spreads",
    [
        ("auto", None, (), False),  # one tree: replaced
        ("auto", (0, 2), (), True),  # a segment's tree of a reduce in parts: spread
        ("auto", (0, 2), ("tcp://w1",), False),  # an allreduce's: never repaired
        ("spread", None, (), True),
        ("spread", (0, 2), ("tcp://w1",), False),
        ("replace", (0, 2), (), False),
    ],
)
def test_a_tree_root_spreads_as_configured(repair, segment, copies, spreads):
    @gen_cluster(client=True, nthreads=[("", 1)], config={"hoplite.reduce.repair": repair})
    async def check(c, s, a):
        await c.register_plugin(Hoplite())
        parts = a.plugins["hoplite-worker"].parts
        assert parts.ctx.config.reduce_repair == repair
        root = TreeRoot(parts.ctx, parts.reductions, parts.nodes, _spec(segment, copies))
        [first] = root.repair.handle(RepairAsked(1, 0, "tcp://w1"))
        repaired = not isinstance(first, Refuse)  # an allreduce's trees never are
        assert repaired is not bool(copies)
        assert (repaired and root.repair.mode == "spread") is spreads

    check()
