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
from dataclasses import dataclass
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

from benchmarks.cpu_steal import cpu_times, steal_share  # noqa: E402

#: Warm steps of each loop (queries of the ensemble, updates of SGD,
#: iterations of RL) that its p50 and p90 are taken over; the first step of
#: each loop, cold, is reported apart and counts in no figure.
WARM = 10


def timed(fn: Callable[..., Any], *args: Any, runs: int = 3) -> float:
    """The median of ``runs`` calls' seconds (one call alone is noisy: the
    first also faults in fresh memory)."""
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def nbytes(tree: Any) -> int:
    """The bytes of the arrays in ``tree`` (a dict of arrays, nested)."""
    if isinstance(tree, dict):
        return sum(nbytes(v) for v in tree.values())
    return int(tree.nbytes)


@dataclass
class Application:
    """One application: its workload, its compute per task as measured here
    on one core (said in the table), and the bound of one step (None: not a
    loop of steps)."""

    workload: Callable[[Any, list[str]], Any]
    compute: str
    bound: Bound | None = None


@dataclass
class Bound:
    """The least a step can take: the compute on its critical path (each
    task's single-core time, slept or computed; applying an update counts)
    plus, for each collective on it, its bytes over one NIC's bandwidth (a
    broadcast or a reduce of S: S/B; a gather into one host of n - 1 objects
    of s: (n - 1) s / B)."""

    compute: float
    #: The bytes each collective on the critical path puts through one NIC.
    transfers: dict[str, int]

    def seconds(self, bytes_per_s: float) -> float:
        return self.compute + sum(self.transfers.values()) / bytes_per_s

    def describe(self, bytes_per_s: float) -> str:
        moved = " + ".join(f"{name} {b / bytes_per_s:.2f}" for name, b in self.transfers.items())
        return f"{self.seconds(bytes_per_s):.2f} s = compute {self.compute:.2f} + {moved}"


def applications(n: int, sleep: bool = False) -> dict[str, Application]:
    """The applications, by name. ``sleep``: the ensemble's predictions, the
    SGD gradients and RL's rollouts, which all hosts compute at once, are
    replaced by a sleep of their measured single-core time (the others always
    compute)."""
    batch = ensemble.load_batch(0, 1365)
    model = ensemble.load_model(0)
    make_batch = timed(ensemble.load_batch, 0, 1365)
    predict = timed(ensemble.predict, model, batch)
    pred = ensemble.predict(model, batch)
    combine = timed(ensemble.combine, *([pred] * n))
    p = 32 * 2**20
    shard = async_sgd.make_shard(0, 200_000, p)
    w = async_sgd.zeros(p)
    grad = timed(async_sgd.scaled_gradient, w, shard, 1e-3)
    update = timed(async_sgd.apply_update, w, w)
    stand_in = grad if sleep else None
    how = "slept" if sleep else "computed"
    policy = rl_weights.init_policy(16384, 1024)
    roll = timed(rl_weights.rollout, policy, 0, 0, 64)
    traj = rl_weights.rollout(policy, 0, 0, 64)
    learn = timed(rl_weights.learn, policy, 1.0, *([traj] * n))
    sgd_bound = Bound(grad + update, {"weights": nbytes(w), "gradients": nbytes(w)})
    return {
        "ensemble serving": Application(
            lambda c, ws: ensemble.workload(c, ws, 1365, WARM, 4, predict if sleep else None),
            f"predict {predict:.2f} s, {how}",
            Bound(
                make_batch + predict + combine,
                {"batch": batch.nbytes, "predictions": (n - 1) * pred.nbytes},
            ),
        ),
        "async SGD (k=6 of 8)": Application(
            lambda c, ws: async_sgd.workload(c, ws, p, 200_000, 6, WARM + 1, 0.5, stand_in),
            f"gradient {grad:.2f} s, {how}; update {update:.2f} s",
            sgd_bound,
        ),
        "sync SGD (k=8 of 8)": Application(
            lambda c, ws: async_sgd.workload(c, ws, p, 200_000, n, WARM + 1, 0.5, stand_in),
            f"gradient {grad:.2f} s, {how}; update {update:.2f} s",
            sgd_bound,
        ),
        "RL weight sync": Application(
            lambda c, ws: rl_weights.workload(
                c, ws, 16384, 1024, 64, WARM + 1, roll if sleep else None
            ),
            f"rollout {roll:.2f} s, {how}; learn {learn:.2f} s, computed",
            Bound(
                roll + learn,
                {"policy": nbytes(policy), "trajectories": (n - 1) * nbytes(traj)},
            ),
        ),
        "dask.array x @ W, y.T @ y": Application(
            lambda c, ws: array_pipeline.workload(c, ws, 4096, 512),
            "matmul per block (not measured)",
        ),
        "dask.bag fold": Application(lambda c, ws: bag_fold.workload(c, ws, 4, 16 * 2**20), "-"),
    }


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` as the nearest rank (p90 of 10: the 9th)."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, round(q * len(s)) - 1))]


def step_row(
    name: str, app: Application, outcomes: dict[str, Any], bytes_per_s: float
) -> list[Any]:
    """One application's warm steps (all but the first) against its bound:
    [name, bound s, hoplite p50 / bound, hoplite p90 / bound, Dask p50 /
    bound, Dask p90 / bound, hoplite p50 s, how the bound is made, hoplite
    max / bound, hoplite's cold first step / bound]."""
    assert app.bound is not None
    bound = app.bound.seconds(bytes_per_s)
    ours, theirs = outcomes["hoplite"].steps[1:], outcomes["dask"].steps[1:]
    return [
        name,
        bound,
        statistics.median(ours) / bound,
        quantile(ours, 0.9) / bound,
        statistics.median(theirs) / bound,
        quantile(theirs, 0.9) / bound,
        statistics.median(ours),
        app.bound.describe(bytes_per_s),
        max(ours) / bound,
        outcomes["hoplite"].steps[0] / bound,
    ]


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
    rows, steps = [], []
    bytes_per_s = args.rate_mbit * 1e6 / 8
    apps = {
        name: app
        for name, app in applications(args.workers, args.sleep).items()
        if not args.only or any(s in name for s in args.only)
    }
    with harness.environment(args) as new_client:  # one emulated network for all
        for name, app in apps.items():
            compute = app.compute
            print(f"# {name} ({harness.describe(args)})", flush=True)
            before = cpu_times()
            outcomes = harness.compare(args, app.workload, new_client)
            steal = steal_share(before, cpu_times())
            if app.bound is not None:
                steps.append(step_row(name, app, outcomes, bytes_per_s))
                for mode in ("dask", "hoplite"):
                    seconds = " ".join(f"{s:.2f}" for s in outcomes[mode].steps)
                    print(f"#   {mode} steps, s: {seconds}", flush=True)
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
    print_steps(steps)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(args.out + "-steps.json", "w") as f:
        json.dump(steps, f, indent=1)
    plot(rows, args.out + ".png")
    return 0


def print_steps(steps: list[list[Any]]) -> None:
    """Each loop's step against its bound, and async SGD's step against sync's."""
    if not steps:
        return
    header = (
        f"\n{'application':<24}{'bound s':>8}{'cold':>7}{'p50':>7}{'p90':>7}{'max':>7}"
        f"{'Dask p50':>10}{'Dask p90':>10}  (x bound; p50, p90, max of the warm steps)  bound"
    )
    print(header + "\n" + "-" * (len(header) - 1))
    for name, bound, p50, p90, d50, d90, _, how, top, cold in steps:
        print(
            f"{name:<24}{bound:>8.2f}{cold:>7.2f}{p50:>7.2f}{p90:>7.2f}{top:>7.2f}"
            f"{d50:>10.2f}{d90:>10.2f}  {how}"
        )
    p50s = {row[0]: row[6] for row in steps}
    both = [p50s.get(k) for k in ("async SGD (k=6 of 8)", "sync SGD (k=8 of 8)")]
    if None not in both:
        print(
            f"async SGD's p50 step is {both[0] / both[1]:.3f}x sync SGD's "
            f"({both[0]:.2f} s against {both[1]:.2f} s)"
        )


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
