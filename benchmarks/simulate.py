"""Flow-level simulation of hoplite's broadcast and reduce (the real directory
and planner, :mod:`benchmarks.simulator`), calibrated against the emulated
cluster, then run where the emulation cannot go: 1,024 workers at 10 Gbit/s.

    # calibrate on measurements and print predicted against measured
    python benchmarks/simulate.py --calibrate benchmarks/results/scaling.json

    # the 1,024-worker table (calibrated on the default measurement files first,
    # their runs pooled per configuration; here fitted at N = 8 and 16 only),
    # in as many parts as the library's planner chooses (core/shape_choice.py)
    python benchmarks/simulate.py --fit-workers 8 16 --out benchmarks/results/simulation-1024

    # beside given part counts, and both repairs of a dead reduce node
    python benchmarks/simulate.py --fit-workers 8 16 --parts auto 1 8 \
        --reduce-repair replace spread --out benchmarks/results/simulation-1024-pooled

Scenarios for a broadcast from one worker to all others and a reduce of one
object per worker: (a) every receiver / input ready at t=0; (b) receivers
arriving (inputs becoming ready) uniformly at random over ``--spread`` seconds;
(c) ``--fail`` of the workers (not the source or the root), chosen at random,
dying at random times within the middle 80% of the run (a). Each is reported in
seconds and as a ratio to S/B; (b) also to (last arrival + S/B), since no
receiver can finish before it arrived plus S/B.

By default (``--parts auto``) the shape is the one the library chooses
(:func:`~dask_hoplite.core.shape_choice.choose_parts`): a broadcast in parts
is then the directory's split of the key into byte ranges, received into one
buffer. A broadcast with a given number of parts is ``dask_hoplite.broadcast(x,
parts=k)``, which pays besides its streams the join of the parts on every
receiver (a copy of S at ``--copy-rate``) and the ``k + 2`` tasks that cut the
object first (:data:`TASK_SECONDS` each). A reduce in parts makes each segment
in its place in the result: nothing more.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks.simulator import calibrate  # noqa: E402
from benchmarks.simulator.broadcast import Outcome, dask_broadcast, hoplite_broadcast  # noqa: E402
from benchmarks.simulator.params import Cluster, Overheads, address  # noqa: E402
from benchmarks.simulator.reduce import HopliteReduce, SplitReduce, dask_reduce  # noqa: E402
from benchmarks.simulator.spread_repair import SpreadReduce  # noqa: E402
from dask_hoplite.config import REDUCE_REPAIRS, resolve_repair  # noqa: E402
from dask_hoplite.core.shape_choice import choose_parts  # noqa: E402

#: One simulated run: (arrivals, failures) -> outcome.
Run = Callable[[Mapping[str, float] | None, Mapping[str, float] | None], Outcome]
#: How a dead reduce node is repaired, by name (``--reduce-repair``).
REPAIRS: dict[str, type[HopliteReduce]] = {"replace": HopliteReduce, "spread": SpreadReduce}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
#: Bytes per second a receiver of ``dask_hoplite.broadcast(x, parts=k)`` joins
#: the parts at (``np.concatenate`` into warm memory: 11-16 GB/s measured on
#: the development machine, taken lower).
COPY_RATE = 10e9
#: Seconds each task that cuts the object costs that broadcast (Dask's
#: overhead per task is of the order of a millisecond).
TASK_SECONDS = 1e-3
#: Result files that copy rows of others (counting them would count runs twice).
DERIVED = {"scaling-calibration.json"}
#: Every result file on record: the entries the simulator models are pooled per
#: configuration (median of the runs), the rest are skipped.
DEFAULT_MEASUREMENTS = sorted(
    p for p in glob.glob(os.path.join(RESULTS, "*.json")) if os.path.basename(p) not in DERIVED
)


@dataclass
class Row:
    collective: str
    method: str
    scenario: str
    n_workers: int
    size: float
    gbit: float
    seconds: float
    bound_seconds: float  # S/B
    ratio_bound: float = 0.0
    last_arrival: float = 0.0
    ratio_arrival_bound: float = 0.0  # seconds / (last arrival + S/B)
    depth: int = 0  # longest relay chain (broadcast) / tree height (reduce)
    resumes: int = 0  # broadcast: streams resumed; reduce: whole-tree restarts
    repairs: int = 0  # reduce nodes replaced
    events: int = 0
    wall_seconds: float = 0.0


def calibration_table(paths: list[str], workers: list[int] | None = None) -> Overheads:
    """Fit the overheads to the runs in ``paths``, pooled per configuration
    (median), on the cluster sizes ``workers`` (all if None); print every
    pooled entry, fitted or not, predicted against measured."""
    data = calibrate.pool(calibrate.load(paths))
    if not data:
        raise SystemExit(f"no modelled entries (hoplite/dask broadcast, reduce) in {paths}")
    best, fitted = calibrate.fit(data, workers=workers)
    used = set(calibrate.fitted(data, workers))
    print(
        f"fitted {', '.join(fitted)} on N = {', '.join(map(str, workers or ['all']))}: "
        f"efficiency {best.efficiency:.3f}, "
        f"hop latency {best.hop_latency * 1e3:.2f} ms, setup {best.setup * 1e3:.2f} ms"
        + ("" if "setup" in fitted else " (fixed: one cluster size only)")
    )
    hdr = (
        f"{'collective':<10} {'op':<10} {'N':>3} {'S':>10} {'Mbit':>5} {'runs':>4} "
        f"{'min':>7} {'max':>7} {'median':>7} {'predicted':>9} {'error':>7}  fitted"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in calibrate.compare(data, best):
        m = r.m
        print(
            f"{m.collective:<10} {m.op:<10} {m.n_workers:>3} "
            f"{format_bytes(m.size):>10} {m.rate_mbit:>5.0f} {len(m.runs):>4} {min(m.runs):>7.3f} "
            f"{max(m.runs):>7.3f} {m.seconds:>7.3f} {r.predicted:>9.3f} {r.error:>+6.1f}%  "
            + ("yes" if m in used else "no")
        )
    return best


def _row(
    collective: str, method: str, scenario: str, n: int, size: float, cluster: Cluster
) -> tuple[Row, float]:
    bound = size / cluster.bandwidth
    row = Row(collective, method, scenario, n, size, cluster.bandwidth * 8 / 1e9, 0.0, bound)
    return row, time.perf_counter()


def _fill(row: Row, out: Outcome, t0: float, last_arrival: float = 0.0) -> Row:
    row.seconds = out.seconds
    row.ratio_bound = out.seconds / row.bound_seconds
    row.last_arrival = last_arrival
    row.ratio_arrival_bound = out.seconds / (last_arrival + row.bound_seconds)
    row.depth, row.resumes, row.repairs, row.events = (
        out.depth,
        out.resumes,
        out.repairs,
        out.events,
    )
    row.wall_seconds = time.perf_counter() - t0
    return row


def planned_parts(collective: str, n: int, size: float, cluster: Cluster) -> int:
    """The parts the library's planner chooses for this run, given what its
    network model would measure: the per-host rate and the hop latency."""
    return choose_parts(
        "broadcast" if collective == "broadcast" else "reduce",
        n,
        int(size),
        cluster.rate,
        cluster.overheads.hop_latency,
        cluster.block_bytes,
    )


def split_costs(out: Outcome, size: float, parts: int, copy_rate: float) -> Outcome:
    """``out`` of ``dask_hoplite.broadcast(x, parts)`` with what it pays
    besides its streams: the join (a copy of the object; free if
    ``copy_rate`` is 0) and the tasks that cut the object before any stream
    starts."""
    if parts > 1:
        extra = (size / copy_rate if copy_rate > 0 else 0.0) + (parts + 2) * TASK_SECONDS
        out.seconds += extra
        out.finish = {w: t + extra for w, t in out.finish.items()}
    return out


def _broadcast(
    cluster: Cluster,
    n: int,
    size: float,
    parts: int,
    copy_rate: float,
    cut: bool,
    arrivals: dict[str, float] | None,
    failures: dict[str, float] | None,
) -> Outcome:
    out = hoplite_broadcast(cluster, n, size, arrivals, failures, parts=parts)
    return split_costs(out, size, parts, copy_rate) if cut else out


def _reduce(
    cluster: Cluster,
    n: int,
    size: float,
    parts: int,
    seed: int,
    repair: str,
    recompute: float,
    arrivals: dict[str, float] | None,
    failures: dict[str, float] | None,
) -> Outcome:
    tree_class = REPAIRS[repair]
    if parts == 1:
        return tree_class(cluster, n, size, seed=seed, recompute=recompute).run(arrivals, failures)
    return SplitReduce(
        cluster, n, size, parts, tree_class=tree_class, seed=seed, recompute=recompute
    ).run(arrivals, failures)


def _method(parts: int, asked: str) -> str:
    """A run's method label: its parts, and "auto" where the planner chose."""
    label = "hoplite" if parts == 1 else f"hoplite-parts{parts}"
    return f"{label}-auto" if asked == "auto" else label


def scenarios(args: argparse.Namespace, overheads: Overheads) -> list[Row]:
    n, size = args.workers, args.size
    cluster = Cluster(args.gbit * 1e9 / 8, overheads, block_bytes=args.block_bytes)
    rng = random.Random(args.seed)
    workers = [address(i) for i in range(n)]
    arrivals = {w: rng.uniform(0, args.spread) for w in workers}
    arrivals[workers[0]] = 0.0  # the broadcast's source holds the object at t=0
    n_fail = max(1, round(args.fail * n))
    rows = []

    def runs(collective: str, run: Run, victims_from: list[str], method: str = "hoplite") -> None:
        row, t0 = _row(collective, method, "a: all at t=0", n, size, cluster)
        base = _fill(row, run(None, None), t0)
        rows.append(base)
        if "b" in args.scenarios:
            label = f"b: arrivals over {args.spread:g}s"
            row, t0 = _row(collective, method, label, n, size, cluster)
            rows.append(_fill(row, run(arrivals, None), t0, max(arrivals.values())))
        if "c" in args.scenarios:
            frng = random.Random(f"{args.seed}:{collective}")
            victims = frng.sample(victims_from, n_fail)
            fails = {w: frng.uniform(0.1, 0.9) * base.seconds for w in victims}
            label = f"c: {n_fail} fail ({args.fail:.0%})"
            row, t0 = _row(collective, method, label, n, size, cluster)
            rows.append(_fill(row, run(None, fails), t0))

    def each_parts(collective: str) -> list[tuple[int, str]]:
        out = []
        for asked in args.parts if collective in args.collectives else ():
            parts = planned_parts(collective, n, size, cluster) if asked == "auto" else int(asked)
            out.append((parts, asked))
        return out

    for parts, asked in each_parts("broadcast"):
        cut = 0.0 if asked == "auto" else args.copy_rate  # ranges, or cut and joined
        runs(
            "broadcast",
            partial(_broadcast, cluster, n, size, parts, cut, asked != "auto"),
            workers[1:],
            _method(parts, asked),
        )
    for parts, asked in each_parts("reduce"):
        if parts == 1:
            plan = HopliteReduce(cluster, n, size)
            root = plan.host_of_node_before_start(plan.tree.root)
        else:
            root = workers[0]  # SplitReduce roots every segment's tree there
        resolved = [resolve_repair(r, in_parts=parts > 1) for r in args.reduce_repair]
        for repair in dict.fromkeys(resolved):  # each repair once, in order
            run: Run = partial(_reduce, cluster, n, size, parts, args.seed, repair, args.recompute)
            method = _method(parts, asked)
            method += "" if repair == "replace" else f"-{repair}"
            runs("reduce", run, [w for w in workers if w != root], method)
    if args.dask:
        row, t0 = _row("broadcast", "dask", "a: all at t=0", n, size, cluster)
        rows.append(_fill(row, dask_broadcast(cluster, n, size), t0))
        row, t0 = _row("reduce", "dask-task", "a: all at t=0", n, size, cluster)
        rows.append(_fill(row, dask_reduce(cluster, n, size), t0))
    return rows


def print_rows(rows: list[Row]) -> None:
    hdr = (
        f"{'collective':<10} {'method':<21} {'scenario':<22} {'seconds':>8} {'x S/B':>7} "
        f"{'x (last+S/B)':>12} {'depth':>5} {'resumes':>7} {'repairs':>7} {'wall s':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        arr = f"{r.ratio_arrival_bound:.2f}" if r.last_arrival else "-"
        print(
            f"{r.collective:<10} {r.method:<21} {r.scenario:<22} {r.seconds:>8.3f} "
            f"{r.ratio_bound:>7.2f} {arr:>12} {r.depth:>5} {r.resumes:>7} {r.repairs:>7} "
            f"{r.wall_seconds:>6.1f}"
        )


def _label(r: Row) -> str:
    """A bar's label: collective, variant (parts, repair), scenario letter."""
    variant = r.method.removeprefix("hoplite").lstrip("-") or "parts1"
    return "\n".join([r.collective, *variant.split("-"), r.scenario.split(":")[0]])


def plot(rows: list[Row], path: str, overheads: Overheads) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hop = [r for r in rows if r.method.startswith("hoplite")]
    labels = [_label(r) for r in hop]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(hop)), 4.5))
    ax.bar(range(len(hop)), [r.ratio_bound for r in hop], color="tab:blue", label="x S/B")
    arr = [(i, r.ratio_arrival_bound) for i, r in enumerate(hop) if r.last_arrival]
    if arr:
        xs, ys = zip(*arr, strict=True)
        ax.plot(xs, ys, "o", color="tab:orange", label="x (last arrival + S/B)")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.5, color="tab:red", lw=0.8, ls="--", label="1.5x target")
    ax.set_xticks(range(len(hop)), labels, fontsize=6)
    ax.set_ylabel("time / (S/B)")
    r0 = rows[0]
    ax.set_title(
        f"simulated hoplite, {r0.n_workers} workers, {r0.size / 1e9:g} GB, {r0.gbit:g} Gbit/s, "
        f"hop latency {overheads.hop_latency * 1e3:.1f} ms",
        fontsize=10,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parts(value: str) -> str:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise argparse.ArgumentTypeError(f"parts must be 'auto' or a positive int, got {value!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", nargs="+", metavar="RESULTS.json", help="fit and compare only")
    p.add_argument("--measurements", nargs="+", default=DEFAULT_MEASUREMENTS)
    p.add_argument(
        "--fit-workers",
        nargs="+",
        type=int,
        help="fit on these cluster sizes only (default: every size); the rest are predicted",
    )
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--size", type=parse_bytes, default=int(1e9))
    p.add_argument("--gbit", type=float, default=10.0)
    p.add_argument("--spread", type=float, default=1.0, help="arrivals over this many seconds")
    p.add_argument("--fail", type=float, default=0.01, help="share of workers that die")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--collectives", nargs="+", choices=("broadcast", "reduce"), default=("broadcast", "reduce")
    )
    p.add_argument(
        "--scenarios", default="abc", help="which of a (t=0), b (arrivals), c (failures); a always"
    )
    p.add_argument(
        "--parts",
        nargs="+",
        type=_parts,
        default=["auto"],
        help="broadcast / reduce in this many parts (split trees), or 'auto' (the default: "
        "as many as the library's planner chooses, core/shape_choice.py); one run per value",
    )
    p.add_argument(
        "--copy-rate",
        type=float,
        default=COPY_RATE,
        help="bytes/s of the join of parts into one object by a broadcast with a given "
        "number of parts (default: 10 GB/s); 0: joins cost nothing",
    )
    p.add_argument(
        "--reduce-repair",
        nargs="+",
        choices=REDUCE_REPAIRS,
        default=["auto"],
        help="how a dead reduce node is repaired, as hoplite.reduce.repair: 'replace' (a "
        "node for its input), 'spread' (benchmarks/simulator/spread_repair.py), 'auto' "
        "(the default: spread in parts, replace in one tree)",
    )
    p.add_argument("--block-bytes", type=parse_bytes, default=Cluster.block_bytes)
    p.add_argument("--hop-latency", type=float, help="seconds; overrides the calibration")
    p.add_argument(
        "--recompute",
        type=float,
        default=0.0,
        help="seconds Dask takes to recompute a dead worker's reduce input (default 0: "
        "at once); the dead node's parent waits that long before any repair",
    )
    p.add_argument("--no-dask", dest="dask", action="store_false")
    p.add_argument("--out", default=os.path.join(RESULTS, "simulation-1024"))
    args = p.parse_args(argv)
    missing = [m for m in args.calibrate or args.measurements if not os.path.exists(m)]
    if missing:
        p.error(f"no such measurement file: {', '.join(missing)}")
    if args.calibrate:
        calibration_table(args.calibrate, args.fit_workers)
        return
    overheads = calibration_table(args.measurements, args.fit_workers)
    if args.hop_latency is not None:
        overheads = Overheads(overheads.efficiency, args.hop_latency, overheads.setup)
    print(
        f"\n{args.workers} workers, {args.size / 1e9:g} GB, {args.gbit:g} Gbit/s, "
        f"overheads {overheads}"
    )
    rows = scenarios(args, overheads)
    print_rows(rows)
    with open(args.out + ".json", "w") as f:
        json.dump({"overheads": asdict(overheads), "rows": [asdict(r) for r in rows]}, f, indent=1)
    plot(rows, args.out + ".png", overheads)
    print(f"wrote {args.out}.json and {args.out}.png")


if __name__ == "__main__":
    main()
