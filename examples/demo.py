"""dask-hoplite demo: one large array consumed by a task on every worker.

Dask's default has every consumer pull a whole copy from the single holder;
with the plugin the copies stream through a pipelined chain that the
scheduler-side directory forms as the fetches arrive. The demo runs the same
workload both ways, checks that the results are identical and prints the time
of each.

When run as root with iproute2 it builds an emulated cluster of 8 hosts with
1 Gbit/s NICs (network namespaces, see benchmarks/emulation.py), where the
network is the bottleneck as on a real cluster; otherwise it uses a
LocalCluster on this machine's loopback, where there is little to win.

    python examples/demo.py [--size 256MiB] [--workers 8] [--rate-mbit 1000] [--local]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The checkout's root, for ``benchmarks.emulation``; appended, so that an
# installed dask_hoplite (a wheel in a virtualenv) is the one imported.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from dask.utils import format_bytes, parse_bytes  # noqa: E402
from distributed import Client, LocalCluster, wait  # noqa: E402

import dask_hoplite  # noqa: E402
from benchmarks import emulation  # noqa: E402
from dask_hoplite.compat import worker_addresses  # noqa: E402


def make_weights(nbytes: int) -> np.ndarray:
    return np.random.default_rng(42).standard_normal(nbytes // 8)


def score(weights: np.ndarray, i: int) -> int:
    """A stand-in for a model evaluated on worker i. An exact integer digest of
    the bits it sees, so "identical" means bit-identical (float sums would vary
    with the buffer's alignment, which differs between Dask's and hoplite's
    receive buffers)."""
    return int(weights.view(np.int64)[i::97].sum())


def workload(client: Client, size: int, use_hoplite: bool) -> tuple[float, list[int]]:
    if use_hoplite:
        client.register_plugin(dask_hoplite.Hoplite())
    workers = worker_addresses(client)
    w = client.submit(make_weights, size, workers=[workers[0]])
    wait(w)
    t0 = time.perf_counter()
    futs = [client.submit(score, w, i, workers=[a], pure=False) for i, a in enumerate(workers)]
    results = client.gather(futs)
    return time.perf_counter() - t0, results


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="256MiB")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--local", action="store_true", help="a LocalCluster even as root")
    args = p.parse_args()
    size = parse_bytes(args.size)
    print(f"dask-hoplite {dask_hoplite.__version__} from {os.path.dirname(dask_hoplite.__file__)}")

    ok, why = (False, "--local") if args.local else emulation.available()
    timings: dict[str, float] = {}
    results: dict[str, list[int]] = {}
    if ok:
        print(
            f"Emulated cluster: {args.workers} worker hosts, {args.rate_mbit:.0f} Mbit/s NICs, "
            f"broadcasting {format_bytes(size)} to a task on each."
        )
        with emulation.EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
            ec.enter_namespace("sched")
            for name in ("dask", "hoplite"):
                ec.start_dask()
                with Client(ec.scheduler_address) as client:
                    timings[name], results[name] = workload(client, size, name == "hoplite")
                ec.stop_dask()
            bound = size / ec.rate_bytes_per_s
    else:
        n = min(args.workers, 4)
        print(
            f"({why}: using a LocalCluster on loopback instead of an emulated network,"
            " where there is little to gain.)"
        )
        print(f"LocalCluster: {n} worker processes, broadcasting {format_bytes(size)}.")
        for name in ("dask", "hoplite"):
            with (
                LocalCluster(n_workers=n, threads_per_worker=1, dashboard_address=":0") as cluster,
                Client(cluster) as client,
            ):
                timings[name], results[name] = workload(client, size, name == "hoplite")
        bound = None

    same = results["dask"] == results["hoplite"]
    print()
    print(f"{'':<22}{'seconds':>9}{'x bound S/B':>13}")
    for name, label in (("dask", "Dask default"), ("hoplite", "with dask-hoplite")):
        ratio = f"{timings[name] / bound:>13.2f}" if bound else f"{'-':>13}"
        print(f"{label:<22}{timings[name]:>9.2f}{ratio}")
    print(
        f"\nspeedup: {timings['dask'] / timings['hoplite']:.2f}x   "
        f"results identical: {'yes' if same else 'NO'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
