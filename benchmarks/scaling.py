"""Broadcast, reduce and allreduce as the cluster grows: N = 4, 8 and 16 worker
hosts, and 4 hosts of 2 worker processes each, hoplite beside Dask's default in
the same run.

Each configuration is one emulated cluster (``emulation.py``); each method runs
on a fresh Dask cluster inside it (``broadcast.measure`` / ``reduce.measure``),
so rep 0 of every row is a *cold* first collective on a fresh cluster (the
``cold s`` column) and ``seconds`` is the median of the warm reps after it.

Configurations (``--configs``, each ``HOSTSxWORKERS@MBIT``):

* ``4x1@1000``, ``8x1@1000``: one worker per host at 1 Gbit/s;
* ``16x1@500``: 16 hosts at 500 Mbit/s, so that 16 workers on a 2-core
  machine are bounded by the emulated NICs and not by the CPU;
* ``4x2@1000``: two worker processes per host, sharing its NIC. The bound is
  per host (every other host's NIC must carry S in); the table also gives the
  bytes each host's NIC received (``max rx/S``: 1.0 means the key entered
  each host once).

Methods: broadcast ``dask`` / ``hoplite`` (one pinned consumer per worker);
reduce ``dask-task`` (one task summing every input) / ``hoplite``
(``dask_hoplite.reduce``); allreduce ``dask-allreduce`` / ``hoplite-allreduce``.
Bounds: S/B for broadcast and reduce, 2(N-1)/N S/B for allreduce (N hosts).

    sudo python benchmarks/scaling.py --size 256MiB --out benchmarks/results/scaling
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks import broadcast, reduce  # noqa: E402
from benchmarks.broadcast import Result  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402

CONFIGS = ("4x1@1000", "8x1@1000", "16x1@500", "4x2@1000")
COLLECTIVES = {
    "broadcast": ("dask", "hoplite"),
    "reduce": ("dask-task", "hoplite"),
    "allreduce": ("dask-allreduce", "hoplite-allreduce"),
}


def parse_config(text: str) -> tuple[int, int, float]:
    """``"16x1@500"`` -> (16 hosts, 1 worker per host, 500 Mbit/s)."""
    try:
        shape, rate = text.split("@")
        hosts, per_host = shape.split("x")
        return int(hosts), int(per_host), float(rate)
    except ValueError:
        raise ValueError(f"config {text!r} is not HOSTSxWORKERS@MBIT, e.g. 8x1@1000") from None


def run_config(
    config: str,
    size: int,
    reps: int,
    collectives: list[str],
    broadcast_methods: list[str] | None = None,
    reduce_methods: list[str] | None = None,
) -> list[tuple[str, Result]]:
    hosts, per_host, rate = parse_config(config)
    out: list[tuple[str, Result]] = []
    with EmulatedCluster(hosts, rate_mbit=rate, workers_per_host=per_host) as ec:
        ec.enter_namespace("sched")  # the Dask clients below talk over the emulated network
        for coll in collectives:
            methods = COLLECTIVES[coll]
            if coll == "broadcast" and broadcast_methods:
                methods = tuple(broadcast_methods)
            if coll == "reduce" and reduce_methods:
                methods = tuple(reduce_methods)
            for method in methods:
                if coll == "broadcast":
                    timeout = max(60.0, 3 * hosts * per_host * size / ec.rate_bytes_per_s)
                    r = broadcast.measure(ec, method, size, reps, timeout)
                else:
                    r = reduce.measure(ec, method, size, reps)
                print(f"# {config} {coll} {method}: {r.all_seconds}", flush=True)
                out.append((coll, r))
    return out


def print_table(rows: list[tuple[str, Result]]) -> None:
    def cfg(r: Result) -> tuple[int, int, float]:
        return (r.n_workers, r.workers_per_host, r.rate_mbit)

    dask = {(c, cfg(r)): r.seconds for c, r in rows if r.op.startswith("dask")}
    hdr = (
        f"{'collective':<10} {'hosts':>5} {'w/host':>6} {'rate':>9} {'method':<18} "
        f"{'cold s':>7} {'cold/SB':>7} {'warm s':>7} {'x S/B':>6} {'x dask':>6} {'max rx/S':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for coll, r in rows:
        vs = r.seconds / dask[(coll, cfg(r))] if (coll, cfg(r)) in dask else float("nan")
        rx = max(r.host_rx_bytes) / r.size if r.host_rx_bytes else float("nan")
        print(
            f"{coll:<10} {r.n_workers:>5} {r.workers_per_host:>6} {r.rate_mbit:>5.0f}Mb/s "
            f"{r.op:<18} {r.all_seconds[0]:>7.2f} {r.all_seconds[0] / r.bound_seconds:>7.2f} "
            f"{r.seconds:>7.2f} {r.ratio_bound:>6.2f} {vs:>6.2f} {rx:>8.2f}"
            f"{'' if r.ok else '  FAILED ' + r.note}"
        )


def plot(rows: list[tuple[str, Result]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = list(dict.fromkeys(c for c, _ in rows))
    fig, axes = plt.subplots(1, len(colls), figsize=(4.5 * len(colls), 4), squeeze=False)
    for ax, coll in zip(axes[0], colls, strict=True):
        for op in dict.fromkeys(r.op for c, r in rows if c == coll):
            pts = sorted(
                (r.n_workers, r.ratio_bound)
                for c, r in rows
                if c == coll and r.op == op and r.workers_per_host == 1
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=op)
            for c, r in rows:
                if c == coll and r.op == op and r.workers_per_host > 1:
                    ax.scatter([r.n_workers], [r.ratio_bound], marker="s")
                    ax.annotate(f"{r.n_workers}x{r.workers_per_host}", (r.n_workers, r.ratio_bound))
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="bound")
        ax.set_yscale("log")
        ax.set_xlabel("worker hosts N (16 at 500 Mbit/s)")
        ax.set_ylabel("warm time / bound")
        ax.set_title(f"{coll}, {format_bytes(rows[0][1].size)}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(rows: list[tuple[str, Result]], path: str) -> None:
    with open(path, "w") as f:
        json.dump([{"collective": c, **asdict(r)} for c, r in rows], f, indent=1)


def load(path: str) -> list[tuple[str, Result]]:
    with open(path) as f:
        return [(d.pop("collective"), Result(**d)) for d in json.load(f)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--collectives", nargs="+", choices=list(COLLECTIVES), default=list(COLLECTIVES))
    p.add_argument(
        "--broadcast-methods",
        nargs="+",
        default=list(COLLECTIVES["broadcast"]),
        help="e.g. dask hoplite hoplite-parts2 (dask_hoplite.broadcast in 2 parts)",
    )
    p.add_argument(
        "--reduce-methods",
        nargs="+",
        default=list(COLLECTIVES["reduce"]),
        help="e.g. dask-task hoplite hoplite-parts4 (dask_hoplite.reduce in 4 parts)",
    )
    p.add_argument("--size", default="256MiB")
    p.add_argument("--reps", type=int, default=2, help="warm reps after one cold rep")
    p.add_argument("--out", default="benchmarks/results/scaling")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved run and exit")
    args = p.parse_args(argv)
    if args.show:
        print_table(load(args.show))
        return 0
    for c in args.configs:
        parse_config(c)
    size = parse_bytes(args.size)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    missing: list[str] = []  # configurations that failed or wrote no results
    if len(args.configs) == 1:
        rows = run_config(
            args.configs[0],
            size,
            args.reps,
            args.collectives,
            args.broadcast_methods,
            args.reduce_methods,
        )
        save(rows, args.out + ".json")
    else:
        # One process per configuration: a process enters the emulated
        # scheduler host's namespace once, before any thread starts.
        rows = []
        for config in args.configs:
            part = f"{args.out}-{config.replace('@', '-')}"
            cmd = [sys.executable, os.path.abspath(__file__), "--configs", config, "--out", part]
            cmd += ["--size", args.size, "--reps", str(args.reps)]
            cmd += ["--broadcast-methods", *args.broadcast_methods]
            cmd += ["--reduce-methods", *args.reduce_methods]
            with contextlib.suppress(FileNotFoundError):
                os.remove(part + ".json")  # an earlier run's, interrupted
            done = subprocess.run([*cmd, "--collectives", *args.collectives], check=False)
            if done.returncode != 0 or not os.path.exists(part + ".json"):
                # Say so: a table without the configuration reads as complete.
                missing.append(config)
                print(
                    f"configuration {config} failed or wrote no results (exit {done.returncode})",
                    file=sys.stderr,
                    flush=True,
                )
            if os.path.exists(part + ".json"):
                rows += load(part + ".json")
                os.remove(part + ".json")
                with contextlib.suppress(FileNotFoundError):
                    os.remove(part + ".png")
            save(rows, args.out + ".json")  # after every config: a partial run is kept
    print()
    print_table(rows)
    plot(rows, args.out + ".png")
    print(f"\nwrote {args.out}.json and {args.out}.png")
    if missing:
        print(f"failed or missing configurations: {', '.join(missing)}", file=sys.stderr)
    return 0 if all(r.ok for _, r in rows) and not missing else 1


if __name__ == "__main__":
    sys.exit(main())
