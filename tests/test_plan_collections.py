"""Planning a large reduction on the scheduler pays for no garbage collection.

A plan of 1,024 inputs builds thousands of short-lived containers. While
CPython's collector ran during planning, it moved them up a generation at
each young collection, and about one plan in twenty then ran a full
collection of the scheduler's heap: 100 ms of a held event loop instead of
6 ms (``benchmarks/plan_time.py``). The coordinator plans with collection
paused (:mod:`dask_hoplite.scheduler.gc_paused`)."""

from __future__ import annotations

import gc
import traceback

import numpy as np
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.core.reduce_plan import PlanRequest
from dask_hoplite.scheduler.gc_paused import gc_paused

#: The coordinator's and FirstReady's functions that run wholly inside the
#: pause. (When the pause ends, the next allocation may run a young collection
#: of what is still alive then, the answer: that is no part of planning.)
PLANNING = {"_plan_ready", "_plan", "now", "_answer"}


def _planning() -> bool:
    """Whether the current stack is inside the scheduler's planning."""
    return any(
        "dask_hoplite/core/" in f.filename
        or ("dask_hoplite/scheduler/" in f.filename and f.name in PLANNING)
        for f in traceback.extract_stack()
    )


@gen_cluster(client=True, nthreads=[("", 1)] * 2)
async def test_no_collection_runs_while_the_coordinator_plans_1024_inputs(c, s, a, b):
    await c.register_plugin(Hoplite())
    futures = await c.scatter([np.full(4, float(i)) for i in range(1024)])
    request = PlanRequest(
        rid="gc",
        op="sum",
        inputs=tuple(f.key for f in futures),
        k=1024,
        min_bytes=0,
        block_bytes=2**20,
    ).to_msg()
    plan = s.handlers["hoplite_plan_reduction"]
    during: list[int] = []

    def seen(phase, info):
        if phase == "start" and _planning():
            during.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        for _ in range(20):
            answer = await plan(request=request)
            assert answer["plan"]["type"] == "tree"
            assert sorted(answer["plan"]["spec"]["inputs"]) == sorted(f.key for f in futures)
    finally:
        gc.callbacks.remove(seen)
    assert not during, f"collections of generations {during} ran inside planning"


def test_a_pause_keeps_a_disabled_collector_disabled():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
