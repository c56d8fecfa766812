"""Gloo peer for the peers benchmark: ``torch.distributed`` with the "gloo"
backend on CPU tensors, one rank per worker host of an ``EmulatedCluster``.

Rank i runs in host ``w{i}``'s namespace (``GLOO_SOCKET_IFNAME=eth0``,
``MASTER_ADDR`` = host ``w0``'s emulated address), rank 0 is the root. The
operations, on float64 tensors of S bytes: ``dist.broadcast``, ``dist.reduce``
(``SUM``), ``dist.all_reduce``, ``dist.gather``, ``dist.all_gather_into_tensor``
(in place: the input is the rank's slot of the output, so a rank holds N objects
rather than the N + 1 of ``dist.all_gather`` into a list; at 8 x 256 MiB the
ranks still drove this 24 GiB machine's free memory under 1 GiB, as if the
backend gathered through a buffer of its own); the round
trip is ``dist.send``/``dist.recv`` from rank 0 to rank 1 and back.

Timing as in ``mpi_peers.py``: all ranks meet in a barrier, each rank times
its own call from leaving the barrier to its return, and the rep's time is the
maximum over ranks (one ``all_reduce(MAX)`` after the rep, which also carries
every rank's result check). Rep 0 is cold. One launch per object size runs
every operation in turn; torch uses one thread per rank (2 cores for 8 ranks).

Needs the torch CPU build (``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.peers_common import (  # noqa: E402
    Measured,
    bound_seconds,
    mark,
    unmark,
    wait_watched,
)

PORT = 29561


def available() -> tuple[bool, str]:
    try:
        import torch.distributed as dist
    except ImportError as e:
        return False, f"torch not installed ({e}); pip install the torch CPU build"
    if not dist.is_available() or not dist.is_gloo_available():
        return False, "this torch build has no gloo backend"
    return True, ""


# ------------------------------------------------------------ rank program


def _buffers(op: str, count: int, rank: int, n: int, rep: int) -> dict[str, Any]:
    import torch

    f64 = torch.float64
    if op == "broadcast":
        return {"x": torch.full((count,), float(rep + 1) if rank == 0 else 0.0, dtype=f64)}
    if op == "allgather":
        # In place: this rank's input is its slot of the output (N objects per
        # rank in our buffers, not N + 1).
        flat = torch.zeros(n * count, dtype=f64)
        x = flat[rank * count : (rank + 1) * count]
        x.fill_(float(rank + 1))
        return {"x": x, "flat": flat, "out": list(flat.view(n, count))}
    bufs: dict[str, Any] = {"x": torch.full((count,), float(rank + 1), dtype=f64)}
    if op == "gather" and rank == 0:
        bufs["out"] = [torch.zeros(count, dtype=f64) for _ in range(n)]
    if op == "roundtrip":
        bufs["x"].fill_(float(rep + 1) if rank == 0 else 0.0)
        bufs["back"] = torch.zeros(count, dtype=f64)
    return bufs


def _call(op: str, b: dict[str, Any], rank: int) -> None:
    import torch.distributed as dist

    if op == "broadcast":
        dist.broadcast(b["x"], src=0)
    elif op == "reduce":
        dist.reduce(b["x"], dst=0, op=dist.ReduceOp.SUM)
    elif op == "allreduce":
        dist.all_reduce(b["x"], op=dist.ReduceOp.SUM)
    elif op == "gather":
        dist.gather(b["x"], b.get("out"), dst=0)
    elif op == "allgather":
        dist.all_gather_into_tensor(b["flat"], b["x"])
    elif rank == 0:  # roundtrip
        dist.send(b["x"], dst=1)
        dist.recv(b["back"], src=1)
    elif rank == 1:
        dist.recv(b["x"], src=0)
        dist.send(b["x"], dst=0)


def _check(op: str, b: dict[str, Any], rank: int, n: int, rep: int) -> bool:
    total = n * (n + 1) / 2
    x = b["x"]

    def all_eq(t: Any, v: float) -> bool:
        stride = max(1, t.numel() // 4096)
        return bool((t[::stride] == v).all()) and float(t[-1]) == v

    if op == "broadcast":
        return all_eq(x, rep + 1)
    if op == "reduce":
        return rank != 0 or all_eq(x, total)
    if op == "allreduce":
        return all_eq(x, total)
    if op in ("gather", "allgather") and "out" in b:
        return all(all_eq(t, i + 1) for i, t in enumerate(b["out"]))
    if op == "roundtrip" and rank in (0, 1):
        return all_eq(b["back"] if rank == 0 else x, rep + 1)
    return True


def rank_main(ops: Sequence[str], size: int, reps: int, timeout: float) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    rank, n = dist.get_rank(), dist.get_world_size()
    count = size // 8
    for op in ops:
        times, ok = [], True
        for rep in range(reps + 1):
            b = _buffers(op, count, rank, n, rep)
            dist.barrier()
            t0 = time.perf_counter()
            _call(op, b, rank)
            dt = time.perf_counter() - t0
            agg = torch.tensor([dt, 0.0 if _check(op, b, rank, n, rep) else 1.0])
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)
            times.append(float(agg[0]))
            ok = ok and float(agg[1]) == 0.0
            del b
        if rank == 0:
            print(mark(json.dumps({"op": op, "times": times, "ok": ok})), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------ launcher


def _launch(ec: Any, ops: Sequence[str], size: int, reps: int, timeout: float) -> tuple[str, str]:
    """Start one rank per worker host; (rank 0's stdout, why it failed or "")."""
    n = ec.n_workers
    tmp = tempfile.mkdtemp(prefix="hplgloo")
    env = {
        "MASTER_ADDR": ec.hosts["w0"].address,
        "MASTER_PORT": str(PORT),
        "WORLD_SIZE": str(n),
        "GLOO_SOCKET_IFNAME": "eth0",
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, os.path.abspath(__file__), "--rank-program", "--size", str(size)]
    argv += ["--reps", str(reps), "--timeout", str(timeout), "--ops", *ops]
    logs = [os.path.join(tmp, f"rank{i}.log") for i in range(n)]
    procs = [ec.spawn(f"w{i}", argv, {**env, "RANK": str(i)}, log=logs[i]) for i in range(n)]
    why = wait_watched(procs, timeout)
    if not why:
        why = next(
            (f"rank {i} exited {p.returncode}" for i, p in enumerate(procs) if p.returncode), ""
        )
    with open(logs[0]) as f:
        out = f.read()
    if why:
        tail = "".join(open(lg).read()[-1500:] for lg in logs[:2])
        print(f"# gloo {why}; rank logs:\n{tail}", file=sys.stderr, flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return out, why


def run(ec: Any, grid: Sequence[tuple[int, Sequence[str]]], reps: int) -> list[Measured]:
    """``grid``: (size, operations) pairs; one launch of N ranks per size."""
    n = ec.n_workers
    ok, why = available()
    if not ok:
        return [
            Measured("gloo", op, s, n, available=False, note=why) for s, ops in grid for op in ops
        ]
    rows: list[Measured] = []
    for size, ops in grid:
        est = sum(bound_seconds(op, n, size, ec.rate_bytes_per_s) for op in ops) * (reps + 1)
        timeout = 120 + 10 * est
        out, why = _launch(ec, ops, size, reps, timeout)
        got = {d["op"]: d for d in map(json.loads, unmark(out))}
        for op in ops:
            d = got.get(op)
            if d is None:
                rows.append(
                    Measured("gloo", op, size, n, [float("inf")], False, why or "no result")
                )
            else:
                note = "" if d["ok"] else "WRONG RESULT"
                rows.append(Measured("gloo", op, size, n, d["times"], d["ok"], note))
            print(f"# gloo {op} {size}: {rows[-1].all_seconds} {rows[-1].note}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank-program", action="store_true", required=True)
    p.add_argument("--ops", nargs="+", required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    return rank_main(args.ops, args.size, args.reps, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
