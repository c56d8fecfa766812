"""One tree or split trees: the planner's choice of parts (pure), and the
paths that follow it: the reduce planner, the broadcast collective (a real
in-process cluster of seven hosts), the configuration."""

from __future__ import annotations

import asyncio

import dask
import numpy as np
import pytest
from distributed import wait
from distributed.utils_test import gen_cluster
from hypothesis import given, settings
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite import Hoplite
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import PlanRequest, SplitTrees, Tree, plan_reduction
from dask_hoplite.core.shape_choice import (
    MIN_BLOCKS,
    PART_CHOICES,
    choose_parts,
    shape_costs,
    split_depth,
)

GB = 10**9
MiB = 2**20
BLOCK = 512 * 2**10
#: 10 Gbit/s and 1 Gbit/s NICs at the emulated cluster's efficiency, and the
#: calibrated hop latency (benchmarks/simulate.py).
FAST = 1.25e9 * 0.84
SLOW = 125e6 * 0.84
HOP = 0.8e-3


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_a_few_hosts_keep_one_tree_and_a_thousand_split(collective):
    # 8 hosts, 256 MiB at 1 Gbit/s: seven pipeline fills cost less than the
    # join of parts would.
    assert choose_parts(collective, 8, 256 * MiB, SLOW, HOP, BLOCK) == 1
    # 1,024 hosts, 1 GB at 10 Gbit/s: a chain of 1,023 fills takes longer
    # than the transfer itself.
    costs = {c.parts: c for c in shape_costs(collective, 1024, GB, FAST, HOP, BLOCK)}
    parts = choose_parts(collective, 1024, GB, FAST, HOP, BLOCK)
    assert parts > 1
    bound = GB / FAST
    assert costs[1].seconds > 2 * bound
    assert costs[parts].seconds < 1.3 * bound
    assert costs[parts].depth <= 12


def test_parts_too_small_to_pipeline_are_not_considered():
    # 8 MiB in 64 KiB blocks: a part of at least 16 blocks is 1 MiB.
    costs = shape_costs("broadcast", 1024, 8 * MiB, FAST, HOP, 64 * 2**10)
    assert max(c.parts for c in costs) == 8
    assert [c.parts for c in shape_costs("broadcast", 1024, MiB, FAST, HOP, BLOCK)] == [1]


@settings(max_examples=300, deadline=None)
@given(
    collective=st.sampled_from(["broadcast", "reduce"]),
    hosts=st.integers(1, 2048),
    nbytes=st.integers(0, 4 * GB),
    bandwidth=st.sampled_from([SLOW, FAST, 2e9]),
    latency=st.sampled_from([1e-5, HOP, 5e-3]),
    block=st.sampled_from([64 * 2**10, BLOCK]),
)
def test_the_choice_is_a_considered_shape_no_slower_than_one_tree(
    collective, hosts, nbytes, bandwidth, latency, block
):
    costs = shape_costs(collective, hosts, nbytes, bandwidth, latency, block)
    parts = choose_parts(collective, hosts, nbytes, bandwidth, latency, block)
    assert costs[0].parts == 1
    assert parts in {c.parts for c in costs} <= set(PART_CHOICES)
    chosen = next(c for c in costs if c.parts == parts)
    assert chosen.seconds <= costs[0].seconds
    assert all(c.seconds >= nbytes / bandwidth for c in costs)  # never below S/B
    for c in costs[1:]:
        assert c.parts < hosts and nbytes / c.parts >= MIN_BLOCKS * block
    if hosts < 3:
        assert parts == 1


def test_split_depth_is_the_deepest_part_tree():
    assert split_depth(2, 2) == 1
    assert split_depth(1024, 8) <= 5
    assert split_depth(1024, 2) <= 11


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="collective must be"):
        shape_costs("gather", 8, 1, 1.0, 1.0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hosts >= 1"):
        choose_parts("reduce", 0, 1, 1.0, 1.0, 1)


def test_the_reduce_planner_chooses_parts_when_asked_for_auto():
    def plan(n, size, parts):
        workers = [f"tcp://10.{i // 256}.{i % 256}.1:1" for i in range(n)]
        keys = [f"x-{i}" for i in range(n)]
        req = PlanRequest(
            rid="r",
            op="sum",
            inputs=tuple(keys),
            k=n,
            min_bytes=MiB,
            block_bytes=BLOCK,
            parts=parts,
        )
        who_has = {k: [w] for k, w in zip(keys, workers, strict=True)}
        net = NetworkEstimate(FAST, HOP, measured=True)
        return plan_reduction(req, keys, who_has, dict.fromkeys(keys, size), net)

    assert isinstance(plan(8, GB, None), Tree)
    big = plan(1024, GB, None)
    assert isinstance(big, SplitTrees)
    assert len(big.specs) == choose_parts("reduce", 1024, GB, FAST, HOP, BLOCK)
    assert isinstance(plan(1024, GB, 1), Tree)  # a number asked for is kept


def test_parts_settings_are_auto_or_a_positive_int():
    cfg = HopliteConfig.from_dask_config()
    assert cfg.broadcast_parts is None and cfg.reduce_parts is None  # "auto"
    with dask.config.set({"hoplite.broadcast.parts": 8, "hoplite.reduce.parts": "4"}):
        cfg = HopliteConfig.from_dask_config()
        assert (cfg.broadcast_parts, cfg.reduce_parts) == (8, 4)
    for bad in (0, "many", True, 1.5):
        with dask.config.set({"hoplite.reduce.parts": bad}):
            with pytest.raises(ValueError, match="hoplite.reduce.parts must be 'auto'"):
                HopliteConfig.from_dask_config()


SEVEN_HOSTS = [(f"127.0.0.{i}", 1) for i in range(1, 8)]
SMALL = {
    "hoplite.min-bytes": "64 KiB",
    "hoplite.min-block-bytes": "4 KiB",
    "hoplite.block-bytes": "64 KiB",
    "hoplite.window-bytes": "256 KiB",
}


async def _broadcast_records(c, s, workers, x, **kw):
    """The directory records that streamed ``x`` to every worker, by tasks
    that share it as a dependency (what ``dh.broadcast(x)`` submits), and
    the copies (checked)."""
    directory = s.plugins["hoplite"].directory
    keys = []
    start = directory._start

    def spy(rec, sender, receiver, depth):
        keys.append(rec.key)
        return start(rec, sender, receiver, depth)

    directory._start = spy
    ws = [w.address for w in workers]
    copies = await c.gather(await asyncio.to_thread(dh.broadcast, x, ws, **kw))
    for got in copies:
        np.testing.assert_array_equal(got, np.arange(600_000, dtype="f8"))
    directory._start = start
    return keys


@gen_cluster(client=True, nthreads=SEVEN_HOSTS, config=SMALL, timeout=60)
async def test_broadcast_by_default_is_one_chain_on_seven_fast_hosts(c, s, *workers):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 600_000, dtype="f8", workers=[workers[0].address])
    await wait(x)
    assert set(await _broadcast_records(c, s, workers, x)) == {x.key}


@gen_cluster(
    client=True,
    nthreads=SEVEN_HOSTS,
    # A network where every hop costs a second: the planner splits.
    config={**SMALL, "hoplite.reduce.latency": "1s", "hoplite.reduce.bandwidth": "100 MB"},
    timeout=60,
)
async def test_a_key_many_workers_wait_for_travels_in_byte_ranges(c, s, *workers):
    from dask_hoplite.core.byte_ranges import range_key

    await c.register_plugin(Hoplite())
    expected = choose_parts("broadcast", 7, 4_800_000, 100e6, 1.0, 64 * 2**10)
    assert expected > 1
    x = c.submit(np.arange, 600_000, dtype="f8", workers=[workers[0].address])
    await wait(x)
    records = await _broadcast_records(c, s, workers, x)
    ranges = [range_key(x.key, j, expected) for j in range(expected)]
    # Each of the 6 other workers took every range once, each range down a
    # tree: no cut, no extra tasks, no join (one task per worker).
    assert sorted(records, key=str) == sorted(ranges * 6, key=str)
    assert len(s.tasks) == 1 + 7
    # Each receiver counts the key once, received in ranges.
    for w in workers[1:]:
        stats = w.plugins["hoplite-worker"].stats
        assert (stats["keys-received"], stats["keys-received-in-ranges"]) == (1, 1)
    # The worker's copy serves on: a later task on another worker finds it.
    directory = s.plugins["hoplite"].directory
    assert directory.ranges == {x.key: expected}
    del x
    while directory.objects:  # released by Dask: every range record goes
        await asyncio.sleep(0.01)
    assert directory.ranges == {}
