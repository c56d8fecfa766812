"""A broadcast whose inner relay slows down mid-transfer, on an emulated cluster.

The source (an array of S bytes) is made on w0; one consumer pinned to each
other worker is submitted in host order, so that hoplite forms the chain
w0 -> w1 -> ... -> w(N-1). Once ``--at`` of S/B has passed (the relays then
hold about that share of the key), the NIC of one inner relay is cut to
``--slow-factor`` of the rate, both ways, for the rest of the run. Each run
slows another relay (``--relays``, in turn) at another moment (``--at``, in
turn), on a fresh Dask cluster, with hoplite and with Dask's default.

Reported per run, as ratios to S/B: the slowest of the other receivers (a
chain moves at its slowest relay's rate unless the relay is routed around),
the slowed host's own receiver, and how long after the cut hoplite judged the
relay lagging (its scheduler's ``slow-relay`` event). Before each measured
broadcast, one unslowed broadcast of the same size warms the cluster up (and
gives hoplite's network model its measured rate).

    sudo python benchmarks/slow_relay.py --workers 8 --rate-mbit 250 --size 64MiB

Needs root and iproute2 (see ``emulation.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks.broadcast import worker_env  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402
from benchmarks.objects import MAKERS, fingerprint  # noqa: E402

METHODS = ("hoplite", "dask")


@dataclass
class SlowRun:
    method: str
    n_workers: int
    size: int
    rate_mbit: float
    bound: float
    relay: int  # the slowed host: w<relay>
    at: float  # seconds after the consumers were submitted that it slowed
    #: Seconds from submitting the consumers to each consumer's result, by
    #: worker host index (1..N-1).
    finish: dict[int, float] = field(default_factory=dict)
    #: Seconds after the cut that hoplite judged a relay lagging, and which
    #: host ("w3").
    judged: list[tuple[float, str]] = field(default_factory=list)
    reroutes: int = 0  # streams the workers dropped on the directory's word
    ok: bool = True
    note: str = ""

    @property
    def others(self) -> float:
        return max(t for i, t in self.finish.items() if i != self.relay) / self.bound

    @property
    def slowed(self) -> float:
        return self.finish[self.relay] / self.bound


def one_run(
    ec: EmulatedCluster,
    method: str,
    size: int,
    relay: int,
    at: float,
    factor: float,
    timelines: bool = False,
) -> SlowRun:
    """One measured broadcast on a fresh Dask cluster, w<relay> slowed to
    ``factor`` of the rate ``at`` seconds in; with ``timelines``, hoplite's
    receivers record theirs and the slowed broadcast's is printed."""
    from distributed import Client, as_completed, wait

    import dask_hoplite

    bound = size / ec.rate_bytes_per_s
    run = SlowRun(method, ec.n_workers, size, ec.rate_mbit, bound, relay, at)
    ec.start_dask(env=worker_env(**({"DASK_HOPLITE__TIMELINES": "True"} if timelines else {})))
    try:
        with Client(ec.scheduler_address, timeout=60) as client:
            if method == "hoplite":
                client.register_plugin(dask_hoplite.Hoplite())
            workers = ec.worker_addresses(client)
            src, receivers = workers[0], workers[1:]
            stagger = min(0.2, 0.02 * bound)  # a chain in host order
            for rep, slowed in ((0, False), (1, True)):
                x = client.submit(MAKERS["array"], size, rep, workers=[src], pure=False)
                wait(x)
                cut: list[float] = []
                timer = None
                t0 = time.time()
                if slowed:

                    def slow_down(cut: list[float] = cut) -> None:
                        ec.set_rate(f"w{relay}", ec.rate_mbit * factor)
                        cut.append(time.time())

                    timer = threading.Timer(at, slow_down)
                    timer.start()
                got = {}
                for i, w in enumerate(receivers, start=1):
                    f = client.submit(
                        fingerprint, x, workers=[w], pure=False, allow_other_workers=False
                    )
                    got[f.key] = (i, f)
                    time.sleep(stagger)
                finish: dict[int, float] = {}
                for f in as_completed([f for _, f in got.values()]):
                    finish[got[f.key][0]] = time.time() - t0
                results = client.gather([f for _, f in got.values()])
                if len({tuple(r) for r in results}) != 1:
                    run.ok, run.note = False, "consumers saw different bytes"
                if timer is not None:
                    timer.join()
                if slowed and timelines and method == "hoplite":
                    from benchmarks.timeline import collect, render

                    names = {a: f"w{i}" for i, a in enumerate(workers)}
                    print(render(collect(client, x.key), t0, ec.rate_bytes_per_s, names=names))
                del x, got, results
                if slowed:
                    run.finish = finish
                    hosts = {ec.hosts[f"w{i}"].address: f"w{i}" for i in range(ec.n_workers)}
                    run.judged = _judged(client, cut[0], hosts) if cut else []
                    run.reroutes = sum(
                        1 for _, e in client.get_events("hoplite") if e.get("action") == "reroutes"
                    )
    finally:
        ec.set_rate(f"w{relay}")
        ec.stop_dask()
    return run


def _judged(client: Any, cut: float, hosts: dict[str, str]) -> list[tuple[float, str]]:
    """The scheduler's "slow-relay" events: seconds after ``cut``, and the
    relay's host (``hosts``: role by address)."""
    return [
        (t - cut, hosts.get(e["relay"].split("//")[-1].rsplit(":", 1)[0], e["relay"]))
        for t, e in client.get_events("hoplite")
        if e.get("action") == "slow-relay"
    ]


def print_table(runs: list[SlowRun]) -> None:
    print(
        f"{'method':<8} {'slowed':>6} {'at S/B':>6} {'others':>7} {'slowed':>7} "
        f"{'judged after s':<16} {'reroutes':>8}  note"
    )
    for r in runs:
        judged = " ".join(f"{t:.2f} {a}" for t, a in r.judged) or "-"
        print(
            f"{r.method:<8} {'w' + str(r.relay):>6} {r.at / r.bound:>6.2f} {r.others:>7.2f} "
            f"{r.slowed:>7.2f} {judged:<16} {r.reroutes:>8}  {r.note}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=250)
    p.add_argument("--size", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument(
        "--relays", nargs="+", type=int, default=[2, 3, 4, 5, 6], help="hosts to slow, in turn"
    )
    p.add_argument(
        "--at",
        nargs="+",
        type=float,
        default=[0.3, 0.5, 0.7, 0.4, 0.6],
        help="when to slow them, as shares of S/B, in turn",
    )
    p.add_argument("--slow-factor", type=float, default=0.25)
    p.add_argument(
        "--timelines", action="store_true", help="print each slowed broadcast's timelines"
    )
    p.add_argument("--out", default="benchmarks/results/slow-relay")
    args = p.parse_args(argv)
    if any(not 0 < r < args.workers - 1 for r in args.relays):
        p.error(f"an inner relay is one of w1..w{args.workers - 2}")
    runs: list[SlowRun] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        bound = args.size / ec.rate_bytes_per_s
        for i, relay in enumerate(args.relays):
            at = args.at[i % len(args.at)] * bound
            for method in args.methods:
                run = one_run(ec, method, args.size, relay, at, args.slow_factor, args.timelines)
                runs.append(run)
                print_table([run])
    print(
        f"\nN={args.workers}, {args.rate_mbit:g} Mbit/s, S={format_bytes(args.size)}, "
        f"S/B={args.size / (args.rate_mbit * 1e6 / 8):.3f} s, slowed to {args.slow_factor:g} B"
    )
    print_table(runs)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump([asdict(r) for r in runs], f, indent=1)
    print(f"\nwrote {args.out}.json")
    return 0 if all(r.ok for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
