"""What the examples share: a cluster, the same workload run with Dask alone and
with dask-hoplite, and a side-by-side table.

Every example is ordinary Dask code; "with dask-hoplite" means only that
``client.register_plugin(dask_hoplite.Hoplite())`` ran first. By default the
cluster is a ``LocalCluster`` of worker processes on this machine (loopback,
where there is little to win); with ``--emulated`` (root and iproute2) it is an
emulated cluster of hosts with rate-limited NICs (``benchmarks/emulation.py``),
where the network is the bottleneck as on a real cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distributed import Client, LocalCluster  # noqa: E402

import dask_hoplite  # noqa: E402
from dask_hoplite.compat import worker_addresses  # noqa: E402

#: One BLAS thread per worker process: the emulated hosts share this machine's cores.
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Outcome:
    """What one run of a workload measured, and what it computed."""

    result: Any
    #: name -> (value, higher is better)
    metrics: dict[str, tuple[float, bool]] = field(default_factory=dict)
    #: The seconds of each step of a loop (an update, an iteration, a query),
    #: in order, the first one (cold) included.
    steps: list[float] = field(default_factory=list)


Workload = Callable[[Client, list[str]], Outcome]


def loop_metrics(rate: str, first: str, seconds: list[float]) -> dict[str, tuple[float, bool]]:
    """The metrics of a loop whose rounds took ``seconds``: ``rate``, rounds
    per second after the first (the steady state), and ``first``, the first
    round's seconds on its own: it also pays for the cluster's first transfers
    between these workers (fresh connections, receiving memory faulted in for
    the first time). With a single round, its rate."""
    if len(seconds) < 2:
        return {rate: (len(seconds) / sum(seconds), True)}
    return {rate: ((len(seconds) - 1) / sum(seconds[1:]), True), first: (seconds[0], False)}


def add_cluster_arguments(p: argparse.ArgumentParser, workers: int = 8) -> None:
    p.add_argument("--workers", type=int, default=workers, help="worker hosts (processes)")
    p.add_argument(
        "--emulated",
        action="store_true",
        help="an emulated cluster (network namespaces, rate-limited NICs); needs root",
    )
    p.add_argument("--rate-mbit", type=float, default=1000, help="NIC rate with --emulated")


@contextlib.contextmanager
def _local(n: int) -> Iterator[Callable[[], contextlib.AbstractContextManager[Client]]]:
    @contextlib.contextmanager
    def client() -> Iterator[Client]:
        for k, v in SINGLE_THREADED.items():
            os.environ.setdefault(k, v)
        with (
            LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster,
            Client(cluster) as c,
        ):
            c.wait_for_workers(n)
            yield c

    yield client


@contextlib.contextmanager
def _emulated(
    n: int, rate_mbit: float
) -> Iterator[Callable[[], contextlib.AbstractContextManager[Client]]]:
    from benchmarks import emulation

    ok, why = emulation.available()
    if not ok:
        raise SystemExit(f"--emulated: {why}")
    # Each cluster's scheduler and worker logs, to look at when a run goes wrong.
    logs = tempfile.mkdtemp(prefix="hoplite-emulated-logs-")
    print(f"# logs of the emulated clusters: {logs}", flush=True)
    with emulation.EmulatedCluster(n, rate_mbit=rate_mbit) as ec:
        ec.enter_namespace("sched")
        runs = itertools.count()

        # The examples' modules, importable by the workers (a workload called
        # from another script pickles its functions by reference).
        here = os.path.dirname(os.path.abspath(__file__))
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)

        @contextlib.contextmanager
        def client() -> Iterator[Client]:
            log_dir = os.path.join(logs, f"cluster-{next(runs)}")
            os.makedirs(log_dir)
            ec.start_dask(env={**SINGLE_THREADED, "PYTHONPATH": path}, log_dir=log_dir)
            try:
                with Client(ec.scheduler_address) as c:
                    yield c
            finally:
                ec.stop_dask()

        yield client


def describe(args: argparse.Namespace) -> str:
    if args.emulated:
        return f"emulated cluster, {args.workers} hosts, {args.rate_mbit:g} Mbit/s NICs"
    return f"LocalCluster, {args.workers} worker processes (loopback)"


NewClient = Callable[[], contextlib.AbstractContextManager[Client]]


def environment(args: argparse.Namespace) -> contextlib.AbstractContextManager[NewClient]:
    """Where the clusters run: yields a function that starts a fresh cluster
    and returns a client of it. One emulated network per process (its client
    enters the scheduler host's namespace before any thread starts)."""
    return _emulated(args.workers, args.rate_mbit) if args.emulated else _local(args.workers)


def compare(
    args: argparse.Namespace, workload: Workload, new_client: NewClient | None = None
) -> dict[str, Outcome]:
    """Run ``workload`` on a fresh cluster with Dask alone ("dask"), then on
    another with dask-hoplite registered ("hoplite"), in ``new_client``'s
    environment (default: a new one from ``args``)."""
    if new_client is None:
        with environment(args) as new_client:
            return compare(args, workload, new_client)
    outcomes: dict[str, Outcome] = {}
    for mode in ("dask", "hoplite"):
        with new_client() as client:
            if mode == "hoplite":
                client.register_plugin(dask_hoplite.Hoplite())
            outcomes[mode] = workload(client, worker_addresses(client))
    return outcomes


def run_both(
    args: argparse.Namespace,
    title: str,
    workload: Workload,
    agree: Callable[[Any, Any], bool],
) -> int:
    """:func:`compare`, then print the table and whether the results agree.
    Exit status 0 when they do."""
    print(f"{title}\n{describe(args)}\n", flush=True)
    outcomes = compare(args, workload)
    return report(outcomes, agree)


def report(outcomes: dict[str, Outcome], agree: Callable[[Any, Any], bool]) -> int:
    same = agree(outcomes["dask"].result, outcomes["hoplite"].result)
    print(table(outcomes["dask"], outcomes["hoplite"]))
    print(f"\nresults agree: {'yes' if same else 'NO'}")
    return 0 if same else 1


def table(dask: Outcome, hoplite: Outcome) -> str:
    lines = [f"{'':<28}{'Dask':>12}{'dask-hoplite':>14}{'gain':>8}"]
    for name, (value, higher) in dask.metrics.items():
        other = hoplite.metrics[name][0]
        gain = (other / value if higher else value / other) if value and other else float("nan")
        lines.append(f"{name:<28}{value:>12.3f}{other:>14.3f}{gain:>7.2f}x")
    return "\n".join(lines)
