"""Peers: Ray, Gloo, tuned Open MPI, Dask and dask-hoplite on one emulated
cluster, in one table (issue 14, item 4).

Every system runs on the same ``EmulatedCluster`` (N worker hosts, one network
namespace each, NICs capped at the same rate both ways), one after the other
(only one system's processes are up at a time):

* ``dask`` / ``hoplite``: ``dask_hoplite``'s collectives on futures without and
  with the plugin registered (``dask_peer.py``);
* ``mpi-tuned``: mpi4py on Open MPI with forced bandwidth-optimal algorithms
  (``mpi_peers.py``);
* ``ray``: Ray core, object store and tasks pinned to hosts, one raylet per
  host (``ray_peer.py``);
* ``gloo``: ``torch.distributed`` with the gloo backend on CPU tensors, one
  rank per host (``gloo_peer.py``).

Operations, on objects of S bytes of float64 per host: broadcast, reduce (sum),
allreduce, gather, allgather, and a round trip (one object from host 0 to host
1 and back). Each runs 1 cold rep and ``--reps`` warm ones; ``seconds`` is the
median of the warm reps. Every time is shown as a ratio to the physical bound
of its operation (``peers_common.bound_factor``: S/B for broadcast and reduce,
2(N-1)/N * S/B for allreduce, (N-1) S/B into the root for gather and into every
host for allgather, 2 S/B for the round trip) and to Dask in the same run.

A system that cannot run here (not installed, did not start) is printed with
"not available: <reason>" in each of its rows; a size whose peak resident
memory (an allgather holds N*N objects) would not fit in this machine's free
memory is printed as "not run: ...". Needs root and iproute2, and the optional
peers (``pip install -e '.[peers,mpi,bench]'`` with the torch CPU build;
``apt-get install openmpi-bin libopenmpi-dev`` for mpirun).

    flock /tmp/hoplite-bench.lock python benchmarks/peers.py --workers 8 \\
        --sizes 1KiB 1MiB 256MiB
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks import mpi_peers  # noqa: E402
from benchmarks.peers_common import (  # noqa: E402
    OPERATIONS,
    SYSTEMS,
    Measured,
    bound_seconds,
    resident_bytes,
)

MPI_NAME = {"broadcast": "bcast"}  # peers operation -> mpi_peers collective


def fits(op: str, n: int, size: int, available_bytes: float, share: float = 0.85) -> bool:
    """Whether ``op``'s peak resident memory fits in ``share`` of the free memory."""
    return resident_bytes(op, n, size) <= share * available_bytes


def plan(
    ops: Sequence[str], sizes: Sequence[int], n: int, available_bytes: float
) -> tuple[list[tuple[int, list[str]]], list[tuple[int, str]]]:
    """(grid of (size, operations) to run, (size, operation) pairs left out for
    memory). At each size the operations that hold the most memory run last, so
    that one stopped for memory (``wait_watched``) costs only itself."""
    grid, skipped = [], []
    for size in sizes:
        run_ops = [op for op in ops if fits(op, n, size, available_bytes)]
        run_ops.sort(key=lambda op: resident_bytes(op, n, size))
        skipped += [(size, op) for op in ops if op not in run_ops]
        if run_ops:
            grid.append((size, run_ops))
    return grid, skipped


def run_mpi(ec, grid: Sequence[tuple[int, Sequence[str]]], reps: int) -> list[Measured]:
    """``mpi-tuned``: one mpirun per operation and size (Dask is not running)."""
    n = ec.n_workers
    ok, why = mpi_peers.available()
    rows = []
    for size, ops in grid:
        for op in ops:
            if not ok:
                rows.append(Measured("mpi-tuned", op, size, n, available=False, note=why))
                continue
            r = mpi_peers.run(ec, MPI_NAME.get(op, op), size, reps, "mpi-tuned")
            rows.append(Measured("mpi-tuned", op, size, n, r.all_seconds, r.ok, r.note))
            print(f"# mpi-tuned {op} {size}: {r.all_seconds} {r.note}", flush=True)
    return rows


def run_system(ec, system: str, grid, reps: int) -> list[Measured]:
    from benchmarks import dask_peer, gloo_peer, ray_peer

    if system in ("dask", "hoplite"):
        return dask_peer.run(ec, system, grid, reps)
    if system == "mpi-tuned":
        return run_mpi(ec, grid, reps)
    if system == "ray":
        return ray_peer.run(ec, grid, reps)
    return gloo_peer.run(ec, grid, reps)


# ------------------------------------------------------------ table


def rows_for_table(results: Sequence[Measured], rate: float) -> list[dict]:
    """One dict per result with its bound, ratio to the bound and to Dask."""
    dask = {(m.op, m.size): m.seconds for m in results if m.system == "dask" and m.ok}
    out = []
    for m in results:
        b = bound_seconds(m.op, m.n, m.size, rate)
        good = m.available and m.ok and math.isfinite(m.seconds)
        base = dask.get((m.op, m.size))
        out.append(
            {
                **asdict(m),
                "seconds": m.seconds if good else None,
                "bound_seconds": b,
                "x_bound": m.seconds / b if good else None,
                "x_dask": m.seconds / base if good and base else None,
            }
        )
    return out


def _cell(v: float | None, fmt: str) -> str:
    """``v`` formatted, or "-" in the same width when there is no value."""
    width = int(fmt.split(".")[0] or 0)
    return "-".rjust(width) if v is None else format(v, fmt)


def format_table(rows: Sequence[dict]) -> str:
    hdr = (
        f"{'operation':<10} {'S':>9} {'system':<10} {'cold s':>8} {'seconds':>9} "
        f"{'bound s':>8} {'x bound':>8} {'x dask':>7}  note"
    )
    lines = [hdr, "-" * len(hdr)]
    for r in sorted(rows, key=lambda r: (OPERATIONS.index(r["op"]), r["size"])):
        cold = r["all_seconds"][0] if r["all_seconds"] and r["seconds"] is not None else None
        note = r["note"]
        if not r["available"]:
            note = f"not available: {note}"
        elif not r["ok"] and not note.startswith("not run"):
            note = f"FAILED {note}".strip()
        lines.append(
            f"{r['op']:<10} {format_bytes(r['size']):>9} {r['system']:<10} "
            f"{_cell(cold, '8.4f')} {_cell(r['seconds'], '9.4f')} "
            f"{r['bound_seconds']:>8.3g} {_cell(r['x_bound'], '8.2f')} "
            f"{_cell(r['x_dask'], '7.2f')}  {note}"
        )
    return "\n".join(lines)


def format_markdown(rows: Sequence[dict]) -> str:
    """The same table as Markdown (for docs/benchmark-log.md)."""
    out = [
        "| operation | S | system | seconds | bound s | x bound | x dask | note |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in sorted(rows, key=lambda r: (OPERATIONS.index(r["op"]), r["size"])):
        note = r["note"] if r["available"] else f"not available: {r['note']}"
        out.append(
            f"| {r['op']} | {format_bytes(r['size'])} | {r['system']} | "
            f"{_cell(r['seconds'], '.4f')} | {r['bound_seconds']:.3g} | "
            f"{_cell(r['x_bound'], '.2f')} | "
            f"{_cell(r['x_dask'], '.2f')} | {note} |"
        )
    return "\n".join(out)


def plot(rows: Sequence[dict], out_prefix: str, n: int, rate_mbit: float) -> list[str]:
    """One PNG per operation: ratio to the bound against size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for op in OPERATIONS:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for system in SYSTEMS:
            pts = sorted((r["size"], r["x_bound"]) for r in mine if r["system"] == system)
            pts = [(s, y) for s, y in pts if y is not None]
            missing = {r["size"] for r in mine if r["system"] == system} - {s for s, _ in pts}
            label = system + (" (missing: some sizes)" if missing else "")
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=label)
            else:
                ax.plot([], [], label=f"{system} (not available)")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="physical bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["size"] for r in mine})
        ax.set_xticks(sizes, [format_bytes(s) for s in sizes])
        ax.set_xlabel("object size S (per host)")
        ax.set_ylabel("time / physical bound (log)")
        ax.set_title(f"{op}, N={n} hosts, {rate_mbit:.0f} Mbit/s per NIC")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = f"{out_prefix}-{op}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ------------------------------------------------------------ main


def merged(path: str, results: Sequence[Measured]) -> list[Measured]:
    """``results`` plus the saved ones in ``path`` that they do not replace
    (same system, operation and size)."""
    if not os.path.exists(path):
        return list(results)
    with open(path) as f:
        saved = json.load(f)["rows"]
    names = set(Measured.__dataclass_fields__)
    new = {(m.system, m.op, m.size) for m in results}
    old = [Measured(**{k: v for k, v in r.items() if k in names}) for r in saved]
    return [m for m in old if (m.system, m.op, m.size) not in new] + list(results)


def save(path: str, results: Sequence[Measured], args: argparse.Namespace) -> list[dict]:
    """Write the JSON (after every system, so a cut-off run keeps what it
    measured); with ``--merge``, keep the saved rows that this run did not redo."""
    if args.merge:
        results = merged(path, results)
    rows = rows_for_table(results, args.rate_mbit * 1e6 / 8)
    meta = {"n": args.workers, "rate_mbit": args.rate_mbit, "reps": args.reps}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


def measure_all(args: argparse.Namespace, sizes: list[int]) -> list[Measured]:
    import psutil

    from benchmarks.emulation import EmulatedCluster

    results: list[Measured] = []
    grid, skipped = plan(args.ops, sizes, args.workers, psutil.virtual_memory().available)
    gib = psutil.virtual_memory().available / 2**30
    for size, op in skipped:
        need = resident_bytes(op, args.workers, size) / 2**30
        note = f"not run: needs ~{need:.0f} GiB resident, {gib:.0f} GiB free"
        results += [Measured(s, op, size, args.workers, [], False, note) for s in args.systems]
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        for system in args.systems:
            t = time.perf_counter()
            try:
                results += run_system(ec, system, grid, args.reps)
            except Exception as e:  # noqa: BLE001 - reported in the table
                why = f"{type(e).__name__}: {str(e)[:200]}"
                results += [
                    Measured(system, op, s, args.workers, available=False, note=why)
                    for s, ops in grid
                    for op in ops
                ]
            print(f"# {system}: {time.perf_counter() - t:.0f}s", flush=True)
            save(args.out + ".json", results, args)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--sizes", nargs="+", default=["1KiB", "1MiB", "256MiB"])
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--ops", nargs="+", choices=OPERATIONS, default=list(OPERATIONS))
    p.add_argument("--reps", type=int, default=2, help="warm reps after one cold rep")
    p.add_argument("--out", default="benchmarks/results/peers")
    p.add_argument("--show", action="store_true", help="re-print and re-plot the saved JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown too")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the saved JSON that this run does not redo (rerun one system)",
    )
    args = p.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes]
    if args.show:
        with open(args.out + ".json") as f:
            saved = json.load(f)
        rows, meta = saved["rows"], saved["meta"]
    else:
        rows = save(args.out + ".json", measure_all(args, sizes), args)
        meta = {"n": args.workers, "rate_mbit": args.rate_mbit}
    print(format_table(rows))
    if args.markdown:
        print("\n" + format_markdown(rows))
    paths = plot(rows, args.out, meta["n"], meta["rate_mbit"])
    print(f"\nwrote {args.out}.json and {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
