"""How long planning a reduction holds the scheduler's event loop.

Every reduction is planned on the scheduler (its reduction coordinator,
``hoplite_plan_reduction``), inside the scheduler's event loop: while it
plans, the scheduler does nothing else. This script starts a cluster, a
scheduler in this process with ``--workers`` worker processes (the
scheduler's process holds the scheduler and this client, as a real one holds
the scheduler; a garbage collection in it pauses whatever runs, the smaller
its heap the shorter), registers the plugin, scatters ``--inputs`` small
arrays over the workers, and calls the coordinator's handler on the
scheduler ``--reps`` times for a sum of them all, timing each call there.
With every input ready the call never waits: its time is the time the loop
is held (waiting for the inputs, the scheduler's task states, the planner,
the plan's message, pinning the result task). ``--min-bytes 0`` makes the
plan a reduce tree whatever the size (a tree of one node per input is the
planner's largest); ``--parts`` as ``dh.reduce`` takes it.

    python benchmarks/plan_time.py --inputs 1024 --workers 8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.broadcast import quantile  # noqa: E402


async def _time_plans(dask_scheduler: Any, request: dict[str, Any], reps: int) -> list[Any]:
    """On the scheduler: each call's seconds, whether Python ran a full
    garbage collection of the scheduler's process during it, and the last
    plan's type."""
    handler = dask_scheduler.handlers["hoplite_plan_reduction"]
    seconds, collected, kind = [], [], None
    for _ in range(reps):
        full = gc.get_stats()[2]["collections"]
        t0 = time.perf_counter()
        answer = await handler(request=request)
        seconds.append(time.perf_counter() - t0)
        collected.append(gc.get_stats()[2]["collections"] > full)
        kind = answer["plan"]["type"]
    return [seconds, collected, kind]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=int, default=1024)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--min-bytes", type=int, default=0)
    p.add_argument("--parts", type=int, default=1, help="0: as dh.reduce's parts='auto'")
    args = p.parse_args(argv)

    from distributed import Client, LocalCluster

    import dask_hoplite as dh
    from dask_hoplite.config import HopliteConfig
    from dask_hoplite.core.reduce_plan import PlanRequest

    with (
        LocalCluster(
            n_workers=args.workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(dh.Hoplite())
        futures = client.scatter([np.full(16, float(i)) for i in range(args.inputs)])
        req = PlanRequest(
            rid="plan-time",
            op="sum",
            inputs=tuple(f.key for f in futures),
            k=args.inputs,
            min_bytes=args.min_bytes,
            block_bytes=HopliteConfig.from_dask_config().block_bytes,
            parts=args.parts or None,
        )
        seconds, collected, kind = client.run_on_scheduler(
            _time_plans, request=req.to_msg(), reps=args.reps
        )
    print(
        "every plan, ms (* a full garbage collection of the scheduler's process ran in it):",
        " ".join(
            f"{1e3 * s:.1f}{'*' if c else ''}" for s, c in zip(seconds, collected, strict=True)
        ),
    )
    plain = [1e3 * s for s, c in zip(seconds, collected, strict=True) if not c]
    ms = [1e3 * s for s in seconds]
    print(
        f"{args.inputs} inputs on {args.workers} workers, plan {kind}: "
        f"first {ms[0]:.1f} ms, p50 {quantile(ms, 0.5):.1f} ms, "
        f"p90 {quantile(ms, 0.9):.1f} ms, max {max(ms):.1f} ms; "
        f"max without a full collection {max(plain, default=float('nan')):.1f} ms "
        f"(the scheduler's event loop held that long per plan)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
