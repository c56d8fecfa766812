"""The parameter server's steps one by one, with dask-hoplite only: when each
gradient is ready, when the reduce of the first k is done, and when the step
ends, for several k on fresh clusters over one emulated network.

``benchmarks/applications.py`` gives the steps' p50 and p90 against their bound;
this script shows where a step's time goes, and how the first steps of a run
differ from the later ones (a host's first reduce writes into freshly mapped
memory; with k < n the chosen hosts change from step to step, so hosts join
the tree for the first time later in the run). The gradients sleep their
single-core time (``--gradient-seconds``), as ``applications.py --sleep`` does.

    python benchmarks/sgd_steps.py [--workers 8] [--rate-mbit 1000] [--k 6 8 6 8] [--steps 8]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import async_sgd  # noqa: E402
import harness  # noqa: E402
from distributed import Client, as_completed, wait  # noqa: E402

import dask_hoplite as dh  # noqa: E402
from benchmarks import emulation  # noqa: E402
from dask_hoplite.compat import worker_addresses  # noqa: E402

SAMPLES = 200_000


def run(
    client: Client, workers: list[str], params: int, k: int, steps: int, grad_s: float
) -> list[float]:
    """``steps`` steps of the parameter server; prints each; their seconds."""
    grad = functools.partial(async_sgd.scaled_gradient_stand_in, grad_s)
    server = workers[0]
    shards = [
        client.submit(async_sgd.make_shard, i, SAMPLES, params, workers=[w])
        for i, w in enumerate(workers)
    ]
    w_fut = client.submit(async_sgd.zeros, params, workers=[server])
    wait([*shards, w_fut])
    size = async_sgd.step_size(0.5, k, SAMPLES, params)
    seconds = []
    for step in range(steps):
        t0 = time.perf_counter()
        published = client.submit(async_sgd.publish, w_fut, workers=[server], pure=False)
        grads = [
            client.submit(grad, published, s, size, workers=[a], pure=False)
            for s, a in zip(shards, workers, strict=True)
        ]
        total = dh.reduce(grads, "sum", k=k, to=server)
        w_fut = client.submit(async_sgd.apply_update, w_fut, total, workers=[server], pure=False)
        ready = [time.perf_counter() - t0 for _ in as_completed(grads)]
        wait(total)
        reduced = time.perf_counter() - t0
        wait(w_fut)
        seconds.append(time.perf_counter() - t0)
        print(
            f"k={k} step {step}: gradients ready {' '.join(f'{x:.2f}' for x in ready)} s; "
            f"reduce done {reduced:.2f} s; step {seconds[-1]:.2f} s",
            flush=True,
        )
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--params", type=int, default=32 * 2**20, help="float32 parameters")
    p.add_argument("--k", type=int, nargs="+", default=[6, 8, 6, 8], help="one cluster each")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gradient-seconds", type=float, default=0.04)
    args = p.parse_args(argv)
    ok, why = emulation.available()
    if not ok:
        raise SystemExit(why)
    summary = []
    with emulation.EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        path = os.path.join(ROOT, "examples")
        for k in args.k:
            ec.start_dask(env={**harness.SINGLE_THREADED, "PYTHONPATH": path})
            try:
                with Client(ec.scheduler_address) as c:
                    c.register_plugin(dh.Hoplite())
                    ws = worker_addresses(c)
                    seconds = run(c, ws, args.params, k, args.steps, args.gradient_seconds)
            finally:
                ec.stop_dask()
            summary.append((k, seconds))
    print(f"\n{'k':>3}  {'first':>6}  {'steps 1-2':>10}  {'p50 of steps 3-':>16}")
    for k, seconds in summary:
        later = seconds[3:] or seconds
        early = " ".join(f"{s:.2f}" for s in seconds[1:3])
        print(f"{k:>3}  {seconds[0]:>6.2f}  {early:>10}  {statistics.median(later):>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
