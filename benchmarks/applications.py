"""The examples' workloads on the emulated cluster, Dask alone against
dask-hoplite, in one table and one PNG.

Each application is the example's own code (``examples/*.py``) at its default
sizes, run on a fresh Dask cluster without the plugin and on another with it,
over the same emulated network (8 worker hosts at 1 Gbit/s by default). The
tasks compute for real; the table states each one's compute time, measured in
this process on one core before the runs (on this 2-core machine the 8
emulated hosts share the cores, so compute also costs more there than on a
real cluster). With ``--sleep`` the ensemble's predictions, the SGD
gradients and RL's rollouts, which all 8 hosts compute at once, sleep their
measured single-core time instead, as 8 real hosts would take; the table says
which (RL's learner step, on one host, still computes, as do the array and
bag pipelines).

    python benchmarks/applications.py [--workers 8] [--rate-mbit 1000] [--sleep]
        [--only ensemble sgd ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

# One BLAS thread, set before numpy loads: the compute times measured here
# are single-core times, as the workers (one thread each) run them.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

import array_pipeline  # noqa: E402
import async_sgd  # noqa: E402
import bag_fold  # noqa: E402
import ensemble_serving as ensemble  # noqa: E402
import harness  # noqa: E402
import rl_weights  # noqa: E402


def timed(fn: Callable[..., Any], *args: Any, runs: int = 3) -> float:
    """The median of ``runs`` calls' seconds (one call alone is noisy: the
    first also faults in fresh memory)."""
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def cpu_times() -> list[int]:
    """This machine's CPU time counters (``/proc/stat``, all CPUs): user,
    nice, system, idle, iowait, irq, softirq, steal, in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of CPU time the hypervisor took away (steal) between two
    :func:`cpu_times`: on a virtual machine whose host is busy, every figure
    of the run is slower than the machine itself would make it."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return delta[7] / max(1, sum(delta))


def applications(
    n: int, sleep: bool = False
) -> dict[str, tuple[Callable[[Any, list[str]], Any], str]]:
    """name -> (workload, its compute per task measured here on one core).
    ``sleep``: the ensemble's predictions, the SGD gradients and RL's
    rollouts, which all hosts compute at once, are replaced by a sleep of
    their measured single-core time (the others always compute)."""
    batch = ensemble.load_batch(0, 1365)
    model = ensemble.load_model(0)
    predict = timed(ensemble.predict, model, batch)
    p = 32 * 2**20
    shard = async_sgd.make_shard(0, 200_000, p)
    grad = timed(async_sgd.scaled_gradient, async_sgd.zeros(p), shard, 1e-3)
    stand_in = grad if sleep else None
    how = "slept" if sleep else "computed"
    policy = rl_weights.init_policy(16384, 1024)
    roll = timed(rl_weights.rollout, policy, 0, 0, 64)
    traj = rl_weights.rollout(policy, 0, 0, 64)
    learn = timed(rl_weights.learn, policy, 1.0, *([traj] * n))
    return {
        "ensemble serving": (
            lambda c, w: ensemble.workload(c, w, 1365, 6, 4, predict if sleep else None),
            f"predict {predict:.2f} s, {how}",
        ),
        "async SGD (k=6 of 8)": (
            lambda c, w: async_sgd.workload(c, w, p, 200_000, 6, 10, 0.5, stand_in),
            f"gradient {grad:.2f} s, {how}",
        ),
        "sync SGD (k=8 of 8)": (
            lambda c, w: async_sgd.workload(c, w, p, 200_000, n, 10, 0.5, stand_in),
            f"gradient {grad:.2f} s, {how}",
        ),
        "RL weight sync": (
            lambda c, w: rl_weights.workload(c, w, 16384, 1024, 64, 8, roll if sleep else None),
            f"rollout {roll:.2f} s, {how}; learn {learn:.2f} s, computed",
        ),
        "dask.array x @ W, y.T @ y": (
            lambda c, w: array_pipeline.workload(c, w, 4096, 512),
            "matmul per block (not measured)",
        ),
        "dask.bag fold": (lambda c, w: bag_fold.workload(c, w, 4, 16 * 2**20), "-"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_cluster_arguments(p)
    p.add_argument("--only", nargs="*", help="substrings of the application names to run")
    p.add_argument("--out", default="benchmarks/results/applications")
    p.add_argument(
        "--sleep",
        action="store_true",
        help="predictions, SGD gradients and rollouts sleep their single-core time instead of "
        "computing (the emulated hosts share this machine's cores)",
    )
    args = p.parse_args(argv)
    args.emulated = True
    rows = []
    apps = {
        name: app
        for name, app in applications(args.workers, args.sleep).items()
        if not args.only or any(s in name for s in args.only)
    }
    with harness.environment(args) as new_client:  # one emulated network for all
        for name, (workload, compute) in apps.items():
            print(f"# {name} ({harness.describe(args)})", flush=True)
            before = cpu_times()
            outcomes = harness.compare(args, workload, new_client)
            steal = steal_share(before, cpu_times())
            for metric, (value, higher) in outcomes["dask"].metrics.items():
                ours = outcomes["hoplite"].metrics[metric][0]
                gain = ours / value if higher else value / ours
                rows.append([name, metric, value, ours, gain, compute, steal])
                print(
                    f"#   {metric}: Dask {value:.3f}, hoplite {ours:.3f}, {gain:.2f}x, "
                    f"CPU steal {steal:.0%}",
                    flush=True,
                )
    print()
    header = (
        f"{'application':<28}{'metric':<30}{'Dask':>9}{'hoplite':>9}{'gain':>7}{'steal':>7}"
        "  compute/task"
    )
    print(header + "\n" + "-" * len(header))
    for name, metric, value, ours, gain, compute, steal in rows:
        print(
            f"{name:<28}{metric:<30}{value:>9.3f}{ours:>9.3f}{gain:>6.2f}x{steal:>7.0%}  {compute}"
        )
    print(
        "steal: the share of this machine's CPU time its hypervisor took while the application "
        "ran (both modes); figures from a run with much of it are slower than the machine's own"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, args.out + ".png")
    return 0


def plot(rows: list[list[Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.5 * len(rows)))
    labels = [f"{r[0]}\n{r[1]}" for r in rows]
    ax.barh(labels, [r[4] for r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xlabel("dask-hoplite's gain over Dask alone (x)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
