"""A broadcast loop run back to back, as a training or serving loop runs it,
on an emulated cluster: hoplite against Dask's default, in the same sitting.

Each repetition makes its source on the first worker and, without waiting for
it, submits one consumer pinned to each other worker, one ``client.submit``
at a time as user code does; the next repetition starts the moment the last
consumer's result is back and the repetition's futures are dropped: no pause,
no source made ahead of time. A repetition's time runs from the moment the
scheduler learned its source was made to the moment it learned the last
consumer finished (both read from the scheduler's own transition log, one
clock), so the source's own compute is not counted and the client's latency
is not either. Each method runs on ``--clusters`` fresh clusters; the first
repetition on each is cold, the rest are pooled as warm.

    sudo python benchmarks/loop.py --workers 8 --rate-mbit 250 --sizes 64MiB --reps 20

Every time is reported as a ratio to S/B (every receiver's NIC must carry S
bytes). Beside each cluster's times the script prints each repetition's CPU
steal (the VM's CPU time its hypervisor gave to others), so that a slow
stretch the VM caused can be told from one of ours. Needs root and iproute2
(see ``emulation.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks.broadcast import quantile, worker_env  # noqa: E402
from benchmarks.cpu_steal import cpu_times, steal_share  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402
from benchmarks.objects import MAKERS, fingerprint  # noqa: E402

METHODS = ("dask", "hoplite")


@dataclass
class LoopResult:
    method: str
    n_workers: int
    size: int
    rate_mbit: float
    bound: float
    #: Per fresh cluster, every repetition's seconds, the cold one first.
    clusters: list[list[float]] = field(default_factory=list)
    #: Per fresh cluster, the relays hoplite moved out of a chain for lagging
    #: (its "slow-relay" events; none belong in a loop without a fault).
    reroutes: list[int] = field(default_factory=list)
    #: Per fresh cluster, the lowest share of its sender's rate hoplite judged
    #: any relay at (``hoplite.broadcast.slow-relay.ratio`` reroutes below it).
    closest: list[float] = field(default_factory=list)
    #: Per fresh cluster, every repetition's CPU steal: the share of the VM's
    #: CPU time its hypervisor gave to others while the repetition ran
    #: (``/proc/stat``; a slow stretch with steal is the VM's, not ours).
    steal: list[list[float]] = field(default_factory=list)
    ok: bool = True
    note: str = ""

    @property
    def warm(self) -> list[float]:
        return sorted(t for c in self.clusters for t in c[1:])

    @property
    def cold(self) -> list[float]:
        return [c[0] for c in self.clusters if c]


def _memory_at(dask_scheduler: Any, keys: list[Any]) -> dict[Any, float]:
    """When the scheduler moved each of ``keys`` to memory (its transition
    log's timestamp; the last such moment)."""
    wanted = set(keys)
    out: dict[Any, float] = {}
    # One pass over the log: (key, start, finish, recommendations,
    # stimulus_id, timestamp), oldest first.
    for entry in dask_scheduler.story(*keys):
        if entry[0] in wanted and entry[2] == "memory":
            out[entry[0]] = entry[-1]
    return out


#: TCP counters that say a stream lost packets or waited on a timer.
TCP_COUNTERS = (
    "RetransSegs",
    "TCPTimeouts",
    "TCPLossProbes",
    "TCPSackRecovery",
    "TCPLostRetransmit",
)


def _tcp_snapshot(ec: EmulatedCluster) -> dict[str, dict[str, int]]:
    return {
        f"w{i}": {k: v for k, v in ec.tcp_counters(f"w{i}").items() if k in TCP_COUNTERS}
        for i in range(ec.n_workers)
    }


def _tcp_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> str:
    """The counters that moved, per host ("w3 RetransSegs+12")."""
    moved = [
        f"{h} {k}+{after[h][k] - before[h].get(k, 0)}"
        for h in after
        for k in sorted(after[h])
        if after[h][k] != before[h].get(k, 0)
    ]
    return ", ".join(moved) or "none"


def one_cluster(
    ec: EmulatedCluster, method: str, size: int, reps: int, diagnose: bool = False
) -> tuple[list[float], str, int, float, list[float]]:
    """``reps + 1`` repetitions back to back on a fresh Dask cluster: their
    seconds, a note ("" when every consumer saw the source's bytes), the
    relays hoplite rerouted around, the lowest share of its sender's rate it
    judged a relay at, and each repetition's CPU steal. With ``diagnose``,
    the workers record timelines, each repetition reads every host's TCP
    counters before and after (a pause of some 0.1 s between repetitions),
    and the slowest warm repetition's timeline and counters are printed
    beside the median one's."""
    from distributed import Client, wait

    import dask_hoplite

    extra = {"DASK_HOPLITE__TIMELINES": "True"} if diagnose else {}
    ec.start_dask(env=worker_env(**extra))
    seen: list[tuple[float, str, str]] = []  # diagnose: (seconds, timeline, counters)
    times: list[float] = []
    steal: list[float] = []
    note = ""
    reroutes, closest = 0, float("nan")
    try:
        with Client(ec.scheduler_address, timeout=60) as client:
            if method == "hoplite":
                client.register_plugin(dask_hoplite.Hoplite())
            workers = ec.worker_addresses(client)
            src, receivers = workers[0], workers[1:]
            names = {a: f"w{i}" for i, a in enumerate(workers)}
            for rep in range(reps + 1):
                tcp = _tcp_snapshot(ec) if diagnose else {}
                ticks = cpu_times()
                x = client.submit(MAKERS["array"], size, rep, workers=[src], pure=False)
                got = [
                    client.submit(
                        fingerprint, x, workers=[w], pure=False, allow_other_workers=False
                    )
                    for w in receivers
                ]
                wait(got)
                steal.append(steal_share(ticks, cpu_times()))
                keys = [x.key, *(g.key for g in got)]
                at = client.run_on_scheduler(_memory_at, keys=keys)
                if len(at) != len(keys):
                    note = f"repetition {rep}: no memory transition logged for some keys"
                times.append(max(at[g.key] for g in got) - at[x.key])
                if diagnose and method == "hoplite":
                    from benchmarks.timeline import collect, render

                    # t0: the scheduler's moment the source was made (one host's clock)
                    view = render(
                        collect(client, x.key), at[x.key], ec.rate_bytes_per_s, names=names
                    )
                    counters = _tcp_delta(tcp, _tcp_snapshot(ec))
                    seen.append((times[-1], view, f"{counters}; CPU steal {steal[-1]:.1%}"))
                results = client.gather(got)
                if len({tuple(r) for r in results}) != 1:
                    note = f"repetition {rep}: consumers saw different bytes"
                del x, got, results
            events = client.get_events("hoplite")
            reroutes = sum(1 for _, e in events if e.get("action") == "slow-relay")
            if method == "hoplite":
                closest = client.run_on_scheduler(_closest_relay)
    finally:
        ec.stop_dask()
    if seen[1:]:
        warm = sorted(seen[1:], key=lambda s: s[0])
        for what, (t, view, counters) in (("median", warm[len(warm) // 2]), ("slowest", warm[-1])):
            print(f"# {what} warm repetition: {t:.3f} s; TCP counters that moved: {counters}")
            print(view)
    return times, note, reroutes, closest, steal


def _closest_relay(dask_scheduler: Any) -> float:
    """The lowest share of its sender's rate hoplite judged a relay at."""
    closest = dask_scheduler.plugins["hoplite"].service.info()["relay_closest"]
    return float("nan") if closest is None else float(closest)


def print_table(results: list[LoopResult]) -> None:
    print(
        f"{'method':<8} {'N':>3} {'S':>10} {'rate':>9} {'S/B s':>6} {'runs':>4} {'warm':>4} "
        f"{'cold (each run)':<18} {'p50':>5} {'p90':>5} {'max':>5} {'reroutes':>8} "
        f"{'closest':>7}  note"
    )
    for r in results:
        w = r.warm
        cold = " ".join(f"{c / r.bound:.2f}" for c in r.cold)
        row = [quantile(w, q) / r.bound for q in (0.5, 0.9, 1.0)] if w else [float("nan")] * 3
        print(
            f"{r.method:<8} {r.n_workers:>3} {format_bytes(r.size):>10} "
            f"{r.rate_mbit:>6.0f}Mb/s {r.bound:>6.3f} {len(r.clusters):>4} {len(w):>4} "
            f"{cold:<18} {row[0]:>5.2f} {row[1]:>5.2f} {row[2]:>5.2f} {sum(r.reroutes):>8} "
            f"{min((c for c in r.closest if c == c), default=float('nan')):>7.2f}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=250)
    p.add_argument("--sizes", nargs="+", type=parse_bytes, default=[parse_bytes("64MiB")])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--reps", type=int, default=20, help="warm repetitions per cluster")
    p.add_argument("--clusters", type=int, default=3, help="fresh clusters per method")
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="print the timelines and TCP counters of each cluster's median and slowest warm "
        "repetition (workers record timelines; a pause of ~0.1 s to read the counters)",
    )
    p.add_argument("--out", default="benchmarks/results/loop")
    args = p.parse_args(argv)
    results: list[LoopResult] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        for size in args.sizes:
            for method in args.methods:
                r = LoopResult(method, ec.n_workers, size, ec.rate_mbit, size / ec.rate_bytes_per_s)
                for _ in range(args.clusters):
                    times, note, reroutes, closest, steal = one_cluster(
                        ec, method, size, args.reps, args.diagnose
                    )
                    r.clusters.append(times)
                    r.reroutes.append(reroutes)
                    r.closest.append(closest)
                    r.steal.append(steal)
                    if note:
                        r.ok, r.note = False, note
                    print(f"# {method} {format_bytes(size)}: {[round(t, 3) for t in times]}")
                    print(f"#   CPU steal, %: {[round(100 * v, 1) for v in steal]}")
                results.append(r)
    print()
    print_table(results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    print(f"\nwrote {args.out}.json")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
