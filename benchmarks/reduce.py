"""Reduce of N arrays of S bytes (one per worker) on an emulated cluster:
hoplite's pipelined reduce tree against Dask's default, in the same run.

Methods (each on a fresh Dask cluster over the same emulated network):

* ``dask-task``  one task summing all inputs (pulls N-1 whole inputs into one worker);
* ``dask-tree``  a pairwise tree of add tasks (level by level, whole-object fetches);
* ``dask-array`` ``x.sum(axis=0).compute()`` on ``x = da.stack(inputs)`` (Dask's
                 ``split_every`` tree of tasks);
* ``hoplite``    ``dask_hoplite.reduce(futures, "sum")``;
* ``hoplite-array`` the same ``x.sum(axis=0)``, unchanged, with the plugin registered;
* ``dask-bag`` / ``hoplite-bag``: ``b.fold(np.add).compute()`` on a bag with one
  partition per input (Dask's ``split_every`` tree of aggregate tasks; with the
  plugin registered, unchanged user code);
* ``hoplite-model``: ``dask_hoplite.reduce`` of models: each input a dict of 12 arrays
  (leaves of 1/4 down to 1/64 of S, S in all, as a small network's layers), reduced
  leaf by leaf as one tree (compare with ``hoplite`` on one array of S);
* ``dask-allreduce`` / ``hoplite-allreduce``: the sum on every worker (Dask: the
  one-task sum, then one consumer task pinned to each worker; hoplite:
  ``dask_hoplite.allreduce``), bound 2(N-1)/N * S/B;
* ``dask-allreduce-copies``: what ``dask_hoplite.allreduce`` returns, made by Dask:
  the one-task sum, then a copy task pinned to each worker (a future per worker),
  and one consumer task per copy;
* ``dask-gather`` / ``hoplite-gather``: the list of all inputs on worker 0 (one
  task taking all inputs, with and without the plugin), bound (N-1) * S/B;
* ``mpi-reduce``, ``mpi-allreduce``, ``mpi-gather`` and their ``mpi-tuned-*``
  counterparts: mpi4py ``Reduce`` (``MPI.SUM``) / ``Allreduce`` / ``Gather`` to
  rank 0, one rank per worker host, with Open MPI's default algorithm / forced
  ones (``mpi_peers.py``; Dask is stopped meanwhile). Run by default when mpi4py
  and mpirun are installed, skipped with a note otherwise.

Reported as a ratio to the bound S/B (every contributor's NIC must carry S)
and to ``dask-task``, with the largest ingress any host saw (its NIC counter)
and the CPU share of the Dask processes. Needs root and iproute2.

    python benchmarks/reduce.py --workers 8 --rate-mbit 1000 --sizes 64MiB 256MiB
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks import mpi_peers  # noqa: E402
from benchmarks.broadcast import Result, cpu_seconds, plot, print_table  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402

METHODS = (
    "dask-task",
    "dask-tree",
    "dask-array",
    "hoplite",
    "hoplite-model",
    "hoplite-array",
    "dask-bag",
    "hoplite-bag",
    "dask-allreduce",
    "hoplite-allreduce",
    "dask-allreduce-copies",
    "dask-gather",
    "hoplite-gather",
)
MPI_METHODS = mpi_peers.REDUCE_METHODS


def bound_factor(method: str, n: int) -> float:
    """The physical bound in units of S/B."""
    if "allreduce" in method:
        return 2 * (n - 1) / n
    if method.endswith("gather"):
        return n - 1
    return 1.0


def as_list(*xs: np.ndarray) -> list[np.ndarray]:
    return list(xs)


def check_list(xs: list[np.ndarray]) -> tuple[int, float, float]:
    return int(sum(x.size for x in xs)), float(sum(x[0] for x in xs)), float(xs[-1][-1])


def make_input(nbytes: int, i: int) -> np.ndarray:
    return np.full(nbytes // 8, float(i + 1))


#: The leaves of a ``hoplite-model`` input, in 128ths of S: 1 MiB to 32 MiB of 128 MiB.
MODEL_LEAVES = (32, 24, 16, 12, 10, 8, 8, 6, 4, 4, 2, 2)


def make_model(nbytes: int, i: int) -> dict[str, np.ndarray]:
    """A model of ``nbytes``: 12 layers of float64, all ``i + 1``."""
    elems = nbytes // 8
    sizes = [elems * part // 128 for part in MODEL_LEAVES]
    sizes[0] += elems - sum(sizes)
    return {f"layer{j:02d}": np.full(n, float(i + 1)) for j, n in enumerate(sizes)}


def check_model(m: dict[str, np.ndarray]) -> tuple[int, float, float]:
    leaves = list(m.values())
    assert all(float(x[0]) == float(leaves[0][0]) for x in leaves), "leaves differ"
    return int(sum(x.size for x in leaves)), float(leaves[0][0]), float(leaves[-1][-1])


def add_all(*xs: np.ndarray) -> np.ndarray:
    out = xs[0].copy()
    for x in xs[1:]:
        out += x
    return out


def identity(x: np.ndarray) -> np.ndarray:
    return x


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def check(x: np.ndarray) -> tuple[int, float, float]:
    return int(x.size), float(x[0]), float(x[-1])


def plan_shape(client, result) -> str:
    """The plan a ``dh.reduce`` result ran: its type, parts, and the network
    estimate the planner had (bandwidth, latency)."""
    from dask_hoplite.collectives.futures import INPUTS_ATTR

    plan = client.gather(getattr(result, INPUTS_ATTR))
    net = client.sync(client.scheduler.hoplite_network)
    parts = len(plan["specs"]) if "specs" in plan else 1
    return (
        f"{plan['type']}({parts}) at {net['bandwidth'] / 1e6:.0f} MB/s, "
        f"{net['latency'] * 1e3:.1f} ms"
    )


def measure(ec: EmulatedCluster, method: str, size: int, reps: int) -> Result:
    import dask.array as da
    import dask.bag as db
    from dask import delayed
    from distributed import Client, wait

    import dask_hoplite as dh

    ec.start_dask()
    bound = bound_factor(method, ec.n_workers) * size / ec.rate_bytes_per_s
    times: list[float] = []
    ingress: list[int] = []
    cpu: list[float] = []
    ok, note = True, ""
    roles = [f"w{i}" for i in range(ec.n_workers)]
    shapes: list[str] = []
    with Client(ec.scheduler_address, timeout=60) as client:
        if method.startswith("hoplite"):
            client.register_plugin(dh.Hoplite())
        workers = ec.worker_addresses(client)
        n = len(workers)  # one input per worker process
        pids = ec.pids()
        expected = float(n * (n + 1) / 2)
        for _rep in range(reps + 1):  # rep 0 is cold
            make = make_model if method == "hoplite-model" else make_input
            xs = [
                client.submit(make, size, i, workers=[w], pure=False) for i, w in enumerate(workers)
            ]
            wait(xs)
            rx0 = [ec.nic_bytes(r)[1] for r in roles]
            c0 = cpu_seconds(pids)
            t0 = time.perf_counter()
            if method == "dask-task":
                total = client.submit(add_all, *xs, workers=[workers[0]], pure=False)
            elif method == "dask-tree":
                level = xs
                while len(level) > 1:
                    nxt = []
                    for j in range(0, len(level) - 1, 2):
                        nxt.append(client.submit(add, level[j], level[j + 1], pure=False))
                    if len(level) % 2:
                        nxt.append(level[-1])
                    level = nxt
                total = level[0]
            elif method in ("dask-array", "hoplite-array"):
                x = da.stack([da.from_delayed(delayed(f), (size // 8,), dtype="f8") for f in xs])
                # the same user code; with the plugin registered (hoplite-array)
                # the aggregate runs as a reduce tree
                total = client.compute(x.sum(axis=0))
            elif method in ("dask-bag", "hoplite-bag"):
                b = db.from_delayed([delayed(as_list)(f) for f in xs])
                total = client.compute(b.fold(np.add))
            elif method == "dask-allreduce":
                s = client.submit(add_all, *xs, workers=[workers[0]], pure=False)
                total = [client.submit(check, s, workers=[w], pure=False) for w in workers]
            elif method == "dask-allreduce-copies":
                s = client.submit(add_all, *xs, workers=[workers[0]], pure=False)
                copies = [client.submit(identity, s, workers=[w], pure=False) for w in workers]
                total = [client.submit(check, c, pure=False) for c in copies]
            elif method == "hoplite-allreduce":
                total = [client.submit(check, p, pure=False) for p in dh.allreduce(xs, "sum")]
            elif method.endswith("gather"):
                total = client.submit(as_list, *xs, workers=[workers[0]], pure=False)
            elif "-parts" in method:  # hoplite-partsK: reduce(..., parts=K)
                total = dh.reduce(xs, "sum", parts=int(method.rsplit("-parts", 1)[1]))
            else:
                total = dh.reduce(xs, "sum")
            wait(total)
            dt = time.perf_counter() - t0
            c1 = cpu_seconds(pids)
            rx1 = [ec.nic_bytes(r)[1] for r in roles]
            if "allreduce" in method:
                ok_all = len(total) == n and all(
                    r == (size // 8, expected, expected) for r in client.gather(total)
                )
                got = (size // 8, expected, expected) if ok_all else client.gather(total)
            elif method.endswith("gather"):
                got = client.submit(check_list, total, pure=False).result()
                got = (
                    (size // 8, expected, expected)
                    if got == (n * (size // 8), expected, float(n))
                    else got
                )
            else:
                checker = check_model if method == "hoplite-model" else check
                got = client.submit(checker, total, pure=False).result()
            if got != (size // 8, expected, expected):
                ok, note = False, f"WRONG RESULT {got}"
            if method in ("hoplite", "hoplite-model") or "-parts" in method:
                shapes.append(plan_shape(client, total))
            times.append(dt)
            ingress.append(max(b - a for a, b in zip(rx0, rx1, strict=True)))
            cpu.append((c1 - c0) / dt / (os.cpu_count() or 1) * 100)
            del xs, total
            time.sleep(0.5)
    ec.stop_dask()
    warm = times[1:] or times
    if shapes and ok:  # the plans the planner chose, and the network it saw
        counts = ", ".join(f"{s} x{shapes.count(s)}" for s in dict.fromkeys(shapes))
        note = f"plans: {counts}"
    return Result(
        method,
        ec.n_workers,
        size,
        ec.rate_mbit,
        statistics.median(warm),
        times,
        bound,
        int(statistics.median(ingress)),
        statistics.median(cpu),
        ok,
        note,
        ec.workers_per_host,
    )


def measure_mpi(ec: EmulatedCluster, method: str, size: int, reps: int) -> Result:
    """``mpi-*``: mpi4py ``Reduce``/``Allreduce``/``Gather`` on the same hosts (no Dask running)."""
    r = mpi_peers.run_method(ec, method, size, reps)
    return Result(
        method,
        ec.n_workers,
        size,
        ec.rate_mbit,
        r.seconds,
        r.all_seconds,
        bound_factor(method, ec.n_workers) * size / ec.rate_bytes_per_s,
        r.max_rx_bytes,
        r.cpu,
        r.ok,
        r.note,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--sizes", nargs="+", default=["64MiB", "256MiB"])
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS + MPI_METHODS,
        help="default: all (the MPI ones only when mpi4py and mpirun are installed)",
    )
    p.add_argument("--reps", type=int, default=10, help="warm reps after one cold rep")
    p.add_argument("--out", default="benchmarks/results/reduce")
    args = p.parse_args(argv)
    methods = mpi_peers.select_methods(args.methods, METHODS, MPI_METHODS)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    results: list[Result] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        for size in [parse_bytes(s) for s in args.sizes]:
            for method in methods:
                if method in MPI_METHODS:
                    r = measure_mpi(ec, method, size, args.reps)
                else:
                    r = measure(ec, method, size, args.reps)
                print(f"# {method} {format_bytes(size)}: {r.all_seconds}", flush=True)
                results.append(r)
    print()
    print_table(results, nic_label="max ingress", baseline="dask-task")
    with open(args.out + ".json", "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    plot(results, args.out + ".png", title="Reduce (sum)")
    print(f"\nwrote {args.out}.json and {args.out}.png")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
