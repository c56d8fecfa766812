"""Broadcast of S bytes to N workers on an emulated cluster: hoplite against
Dask's default, in the same run.

Methods (each on a fresh Dask cluster over the same emulated network):

* ``dask``            one consumer task pinned to each non-source worker, no plugin
                      (every consumer pulls a whole copy from the one holder);
* ``dask-replicate``  ``client.replicate`` without the plugin (AMM on, the default);
* ``hoplite``         the same pinned consumers with the plugin registered;
* ``hoplite-replicate`` ``client.replicate`` with the plugin;
* ``mpi`` / ``mpi-tuned`` mpi4py ``Bcast`` from rank 0, one rank per worker host, with
                      Open MPI's default algorithm / a forced pipeline (``mpi_peers.py``;
                      Dask is stopped meanwhile). Run by default when mpi4py and
                      mpirun are installed, skipped with a note otherwise.

Every time is reported as a ratio to the physical bound S/B (every receiver's
NIC must carry S bytes) and to Dask's default measured in the same run, with
the source host's egress bytes (from its NIC counters) and the CPU share of the
Dask processes. Needs root and iproute2 (see ``emulation.py``).

    sudo python benchmarks/broadcast.py --workers 8 --rate-mbit 1000 --sizes 1MiB 64MiB 256MiB

With ``--workers-per-host K`` each host runs K worker processes, every one but
the source gets the object, and each host's memory is sampled as well: the sum
of its workers' PSS (``benchmarks/host_pss.py``), its growth from the moment the
object exists and its peak over the memory before the cluster's first object
(issue 42: one copy per host).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks import mpi_peers, timeline  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402
from benchmarks.host_pss import HostPeaks  # noqa: E402
from benchmarks.objects import MAKERS, fingerprint  # noqa: E402

#: The repository, on the workers' import path: tasks name the makers of
#: ``benchmarks.objects`` by reference, and a result's class must import there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark cluster's processes: workers that may
    start processes of their own, and the repository on the import path;
    plus ``extra``."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {"DASK_DISTRIBUTED__WORKER__DAEMON": "False", "PYTHONPATH": path, **extra}


#: "hoplite": tasks on every receiver that share the dependency (the
#: transparent path); "hoplite-collective": dask_hoplite.broadcast(x) with
#: its defaults (hoplite.broadcast.parts).
METHODS = ("dask", "hoplite", "hoplite-collective", "dask-replicate", "hoplite-replicate")
MPI_METHODS = mpi_peers.BROADCAST_METHODS


@dataclass
class Result:
    op: str
    n_workers: int
    size: int
    rate_mbit: float
    seconds: float  # median over the warm reps; inf when it did not finish
    all_seconds: list[float]  # every rep, the first one cold
    bound_seconds: float
    source_tx_bytes: int
    cpu_percent: float
    ok: bool
    note: str = ""
    workers_per_host: int = 1
    #: Bytes each worker host's NIC received in the last rep, in host order.
    host_rx_bytes: list[int] = field(default_factory=list)
    #: What was broadcast (``benchmarks.objects.MAKERS``): "array", or
    #: "wrapped" (a Python object around bytes, which Dask sizes at ~50 bytes).
    obj: str = "array"
    #: With several workers per host, per repetition: the largest growth of
    #: any host's memory (the sum of its workers' PSS, settled samples:
    #: ``benchmarks/host_pss.py``) from the moment the object exists until
    #: every consumer has run, and the largest peak of any host's over its
    #: memory before the cluster's first object (what a receive-buffer pool
    #: keeps between repetitions shows there), bytes.
    host_growth: list[int] = field(default_factory=list)
    host_held: list[int] = field(default_factory=list)
    #: The same growth from every read, settled or not (a read while workers
    #: map a region can count its pages more than once), bytes.
    host_growth_raw: list[int] = field(default_factory=list)
    #: Per repetition, the machine's ``Shmem`` growth (all hosts' shared
    #: regions, read at once: ``benchmarks/host_pss.py``), bytes.
    shmem_growth: list[int] = field(default_factory=list)

    @property
    def ratio_bound(self) -> float:
        return self.seconds / self.bound_seconds


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(
    ec: EmulatedCluster,
    method: str,
    size: int,
    reps: int,
    timeout: float,
    timelines: bool = False,
    obj: str = "array",
) -> Result:
    from distributed import Client, wait

    import dask_hoplite

    make = MAKERS[obj]
    env = worker_env()
    if timelines:
        env["DASK_HOPLITE__TIMELINES"] = "True"
    recorded: list[tuple[float, dict[str, Any]]] = []  # (wall start, timelines) per rep
    tcp: list[dict[str, dict[str, int]]] = []  # TCP counters per host, per rep
    ec.start_dask(env=env)
    bound = size / ec.rate_bytes_per_s
    times: list[float] = []
    tx: list[int] = []
    cpu: list[float] = []
    ok, note = True, ""
    with Client(ec.scheduler_address, timeout=60) as client:
        if method.startswith("hoplite"):
            client.register_plugin(dask_hoplite.Hoplite())
        workers = ec.worker_addresses(client)
        src, receivers = workers[0], workers[1:]
        src_role = "w0"
        roles = [f"w{i}" for i in range(ec.n_workers)]
        host_rx: list[int] = []
        pids = ec.pids()
        per_host = {r: [p.pid for p in ec.hosts[r].procs] for r in roles}
        at_start = HostPeaks(per_host).stop().start_pss if ec.workers_per_host > 1 else {}
        growth: list[int] = []
        held: list[int] = []
        growth_raw: list[int] = []
        shared: list[int] = []
        # Rep 0 is cold (fresh connections, memory faulted in for the first
        # time); the table's `seconds` is the median of the warm reps after it.
        for rep in range(reps + 1):
            x = client.submit(make, size, rep, workers=[src], pure=False)
            wait(x)
            expected = client.submit(fingerprint, x, workers=[src], pure=False).result()
            tx0, _ = ec.nic_bytes(src_role)
            rx0 = [ec.nic_bytes(r)[1] for r in roles]
            tcp0 = {r: ec.tcp_counters(r) for r in roles} if timelines else {}
            c0 = cpu_seconds(pids)
            peaks = HostPeaks(per_host) if at_start else None
            wall0 = time.time()
            t0 = time.perf_counter()
            if method.endswith("replicate"):
                try:
                    client.replicate([x], callback_timeout=timeout)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    ok, note = (
                        False,
                        f"replicate did not finish in {timeout:.0f}s ({type(e).__name__})",
                    )
                    times.append(float("inf"))
                    break
                dt = time.perf_counter() - t0
                holders = client.who_has([x])[x.key]
                if len(holders) < len(workers):
                    note = f"{len(holders)}/{len(workers)} replicas left after return (AMM)"
                got = [
                    client.submit(
                        fingerprint, x, workers=[w], pure=False, allow_other_workers=False
                    )
                    for w in holders
                ]
            elif "-parts" in method or method == "hoplite-collective":
                # dask_hoplite.broadcast(x, parts=k): cut on the holder, each
                # part down its own tree, joined on each receiver (k > 1).
                k = int(method.rsplit("-parts", 1)[1]) if "-parts" in method else None
                copies = dask_hoplite.broadcast(x, workers=receivers, parts=k)
                got = [
                    client.submit(
                        fingerprint, cp, workers=[w], pure=False, allow_other_workers=False
                    )
                    for cp, w in zip(copies, receivers, strict=True)
                ]
                wait(got)
                dt = time.perf_counter() - t0
                del copies
            else:
                got = [
                    client.submit(
                        fingerprint, x, workers=[w], pure=False, allow_other_workers=False
                    )
                    for w in receivers
                ]
                wait(got)
                dt = time.perf_counter() - t0
            c1 = cpu_seconds(pids)
            if peaks is not None:
                peaks.stop()
                growth.append(max(peaks.growth().values()))
                growth_raw.append(max(peaks.raw_growth().values()))
                held.append(max(peaks.peak[r] - at_start[r] for r in roles))
                shared.append(peaks.shmem_growth())
            tx1, _ = ec.nic_bytes(src_role)
            host_rx = [ec.nic_bytes(r)[1] - a for r, a in zip(roles, rx0, strict=True)]
            results = client.gather(got)
            if any(tuple(r) != tuple(expected) for r in results):
                ok, note = False, "WRONG RESULT"
            times.append(dt)
            if timelines and method.startswith("hoplite"):
                recorded.append((wall0, timeline.collect(client, x.key)))
            if timelines:
                tcp.append(
                    {
                        r: {k: v - tcp0[r].get(k, 0) for k, v in ec.tcp_counters(r).items()}
                        for r in roles
                    }
                )
            tx.append(tx1 - tx0)
            cpu.append((c1 - c0) / dt / (os.cpu_count() or 1) * 100)
            del x, got
            time.sleep(0.5)
    ec.stop_dask()
    warm = times[1:] or times
    seconds = statistics.median(warm) if warm else float("inf")
    if recorded:
        _print_timelines(method, times, recorded, workers, ec.rate_bytes_per_s)
    if tcp:
        _print_tcp(method, times, tcp, bound)
    return Result(
        method,
        ec.n_workers,
        size,
        ec.rate_mbit,
        seconds,
        times,
        bound,
        int(statistics.median(tx)) if tx else 0,
        statistics.median(cpu) if cpu else 0.0,
        ok,
        note,
        ec.workers_per_host,
        host_rx,
        obj,
        host_growth=growth,
        host_held=held,
        host_growth_raw=growth_raw,
        shmem_growth=shared,
    )


def _print_timelines(
    method: str,
    times: list[float],
    recorded: list[tuple[float, dict[str, Any]]],
    workers: list[str],
    rate: float,
) -> None:
    """Each receiver's timeline of the slowest warm repetition, of the median
    one, and of the cold one (``benchmarks/timeline.py``)."""
    names = {w: f"w{i}" for i, w in enumerate(workers)}
    warm = sorted(range(1, len(times)), key=lambda i: times[i])
    picks = {"cold": 0}
    if warm:
        picks["median warm"] = warm[len(warm) // 2]
        picks["slowest warm"] = warm[-1]
    for label, i in picks.items():
        wall0, tl = recorded[i]
        print(f"\n# {method}, rep {i} ({label}): {times[i]:.3f} s")
        print(timeline.render(tl, wall0, rate, names=names))


#: The TCP counters that tell a lost segment and how it was recovered.
TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPSpuriousRTOs")


def _print_tcp(
    method: str, times: list[float], tcp: list[dict[str, dict[str, int]]], bound: float
) -> None:
    """Per repetition: its time, and each host's TCP retransmissions and
    retransmission timeouts (RTO: at least 200 ms without bytes on Linux)."""
    print(f"\n# {method}: TCP counters per repetition (hosts with any)")
    for i, (t, hosts) in enumerate(zip(times, tcp, strict=False)):
        seen = {
            r: "/".join(str(c.get(k, 0)) for k in TCP_COUNTERS)
            for r, c in hosts.items()
            if any(c.get(k, 0) for k in TCP_COUNTERS)
        }
        shown = " ".join(f"{r}:{v}" for r, v in seen.items()) or "none"
        print(f"rep {i:>2} {t / bound:5.2f} x S/B  {'/'.join(TCP_COUNTERS)}: {shown}")


def measure_mpi(ec: EmulatedCluster, method: str, size: int, reps: int, timeout: float) -> Result:
    """``mpi``/``mpi-tuned``: mpi4py ``Bcast`` on the same hosts (no Dask running)."""
    r = mpi_peers.run_method(ec, method, size, reps, timeout=60 + (reps + 1) * timeout)
    return Result(
        method,
        ec.n_workers,
        size,
        ec.rate_mbit,
        r.seconds,
        r.all_seconds,
        size / ec.rate_bytes_per_s,
        r.root_tx_bytes,
        r.cpu,
        r.ok,
        r.note,
    )


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` as the issue tracker counts it: the
    ceil(q * n)-th smallest (p90 of 10 is the 9th), inf when empty."""
    if not xs:
        return float("inf")
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def print_table(
    results: list[Result], nic_label: str = "src egress", baseline: str = "dask"
) -> None:
    """One row per result: the cold first repetition, then the p50, p90 and
    max of the warm ones, each as a ratio to S/B; the p50 against the
    baseline's p50 in the same run."""
    base = {(r.size): r.seconds for r in results if r.op == baseline}
    w = max([18, *(len(r.op) for r in results)])
    hdr = (
        f"{'op':<{w}} {'N':>3} {'S':>9} {'rate':>9} {'S/B s':>6} {'reps':>4} "
        f"{'cold':>5} {'p50':>5} {'p90':>5} {'max':>5} {'x ' + baseline:>7} "
        f"{nic_label:>11} {'x S':>5} {'CPU%':>5}  note"
    )
    print(hdr)
    print(f"{'':<{w}} {'':>3} {'':>9} {'':>9} {'':>6} {'warm':>4} (each x S/B)")
    print("-" * len(hdr))
    for r in results:
        b = r.bound_seconds
        warm = r.all_seconds[1:]
        vs = r.seconds / base[r.size] if r.size in base else float("nan")
        print(
            f"{r.op:<{w}} {r.n_workers:>3} {format_bytes(r.size):>9} "
            f"{r.rate_mbit:>6.0f}Mb/s {b:>6.3f} {len(warm):>4} "
            f"{r.all_seconds[0] / b:>5.2f} {quantile(warm, 0.5) / b:>5.2f} "
            f"{quantile(warm, 0.9) / b:>5.2f} {quantile(warm, 1.0) / b:>5.2f} {vs:>7.2f} "
            f"{format_bytes(r.source_tx_bytes):>11} {r.source_tx_bytes / r.size:>5.2f} "
            f"{r.cpu_percent:>5.0f}  {'' if r.obj == 'array' else r.obj + ' '}"
            f"{r.note}{'' if r.ok else ' FAILED'}"
        )


def _in_s(values: list[int], size: int) -> str:
    """Per-repetition bytes as "cold p50 p90 max" of the warm ones, in S."""
    xs = [x / size for x in values]
    warm = xs[1:]
    return (
        f"{xs[0]:.2f} {quantile(warm, 0.5):.2f} {quantile(warm, 0.9):.2f} "
        f"{max(warm, default=xs[0]):.2f}"
    )


def print_hosts(results: list[Result]) -> None:
    """With several workers per host: each method's per-host memory (the
    largest of any host, in S) and the NIC bytes each receiving host took in
    the last repetition (the most of any, in S)."""
    shown = [r for r in results if r.host_growth]
    if not shown:
        return
    print(f"\nper host ({shown[0].workers_per_host} workers each), in S; memory: cold p50 p90 max")
    for r in shown:
        rx = max(r.host_rx_bytes[1:], default=0) / r.size
        print(
            f"{r.op:<18} {format_bytes(r.size):>9}  growth {_in_s(r.host_growth, r.size)}  "
            f"over start {_in_s(r.host_held, r.size)}  NIC in, most of any host {rx:.2f}"
        )
        if r.host_growth_raw:
            print(
                f"{'':<18} {'':>9}  growth from every read, settled or not: "
                f"{_in_s(r.host_growth_raw, r.size)}"
            )
        if r.shmem_growth:
            print(
                f"{'':<18} {'':>9}  the machine's Shmem growth (all hosts' regions): "
                f"{_in_s(r.shmem_growth, r.size)}"
            )


def plot(results: list[Result], path: str, title: str = "Broadcast") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.size for r in results})
    ops = list(dict.fromkeys(r.op for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(ops)
    for i, op in enumerate(ops):
        ys = [
            next((min(r.ratio_bound, 20) for r in results if r.op == op and r.size == s), 0)
            for s in sizes
        ]
        xs = [j + i * width for j in range(len(sizes))]
        ax.bar(xs, ys, width, label=op)
        for x, y in zip(xs, ys, strict=True):
            label = "did not\nfinish" if y >= 20 else f"{y:.2f}"
            ax.text(x, y + 0.2, label, ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="bound S/B")
    ax.set_xticks(
        [j + 0.4 - width / 2 for j in range(len(sizes))], [format_bytes(s) for s in sizes]
    )
    ax.set_ylabel("time / (S/B)  (capped at 20)")
    r0 = results[0]
    ax.set_title(f"{title}, {r0.n_workers} workers, {r0.rate_mbit:.0f} Mbit/s per host")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_saved(path: str) -> None:
    """Print the table of a saved run and redraw its plot (``--show results.json``)."""
    with open(path) as f:
        results = [Result(**r) for r in json.load(f)]
    print_table(results)
    print_hosts(results)
    plot(results, path.removesuffix(".json") + ".png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8, help="hosts")
    p.add_argument(
        "--workers-per-host",
        type=int,
        default=1,
        help="worker processes per host (every one but the source's gets the object; "
        "each host's memory, the sum of its workers' PSS, is sampled)",
    )
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--mtu", type=int, default=1500)
    p.add_argument("--sizes", nargs="+", default=["1MiB", "64MiB", "256MiB"])
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS + MPI_METHODS,
        help="default: all (the MPI ones only when mpi4py and mpirun are installed)",
    )
    p.add_argument("--reps", type=int, default=10, help="warm reps after one cold rep")
    p.add_argument(
        "--timeout-bounds",
        type=float,
        default=15.0,
        help="give up on a replicate after this many times S/B (at least 20 s)",
    )
    p.add_argument(
        "--timelines",
        action="store_true",
        help="record hoplite.timelines in the workers and print each receiver's timeline "
        "of the cold, the median and the slowest warm repetition",
    )
    p.add_argument(
        "--object",
        choices=sorted(MAKERS),
        default="array",
        help="what is broadcast: a numpy array, or a Python object wrapping bytes "
        "(Dask's sizeof says ~50 bytes: the object is measured when it is made)",
    )
    p.add_argument("--out", default="benchmarks/results/broadcast")
    p.add_argument("--show", metavar="JSON", help="print the table of a saved run and exit")
    args = p.parse_args(argv)
    if args.show:
        print_saved(args.show)
        return 0

    methods = mpi_peers.select_methods(args.methods, METHODS, MPI_METHODS)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    results: list[Result] = []
    with EmulatedCluster(
        args.workers, rate_mbit=args.rate_mbit, mtu=args.mtu, workers_per_host=args.workers_per_host
    ) as ec:
        ec.enter_namespace("sched")
        for size in [parse_bytes(s) for s in args.sizes]:
            timeout = max(20.0, args.timeout_bounds * size / ec.rate_bytes_per_s)
            for method in methods:
                if method in MPI_METHODS:
                    r = measure_mpi(ec, method, size, args.reps, timeout)
                else:
                    r = measure(ec, method, size, args.reps, timeout, args.timelines, args.object)
                print(f"# {method} {format_bytes(size)}: {r.all_seconds}", flush=True)
                results.append(r)
    print()
    print_table(results)
    print_hosts(results)
    with open(args.out + ".json", "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    plot(results, args.out + ".png")
    print(f"\nwrote {args.out}.json and {args.out}.png")
    return 0 if all(r.ok for r in results if r.op.startswith(("hoplite", "mpi"))) else 1


if __name__ == "__main__":
    sys.exit(main())
