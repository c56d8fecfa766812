"""Ray peer for the peers benchmark: Ray core (object store and tasks pinned to
hosts), one raylet per host of an ``EmulatedCluster``.

Cluster. ``ray start --head`` in the ``sched`` host's namespace (no CPUs: it
runs the driver only), ``ray start --address`` in every worker host's
namespace with ``--node-ip-address`` = that host's emulated address, one CPU
(the machine has 2 cores for all hosts), a custom resource ``w{i}`` so that
tasks pin to host i, and an object store of ``OBJECT_STORE_BYTES``. No
dashboard, no usage stats, a private temporary directory. Stopping kills the
processes inside the cluster's namespaces by PID (``ray stop`` matches Ray
processes by name machine-wide, which could hit Ray processes that are not
ours).

What a Ray user would write, with objects of S bytes (float64 arrays) made by
one task per host beforehand (not timed):

* ``broadcast``: the object, returned by a task on host 0 (so it lives in host
  0's object store), and a task on every other host that takes it and touches it;
* ``reduce``: one task on host 0 that takes every host's object and sums them
  (its result stays in host 0's object store);
* ``allreduce``: that reduce, then a task on every host that takes the sum;
* ``gather``: one task on host 0 that takes every host's object (Ray fetches
  them into host 0's object store) and touches each;
* ``allgather``: that task on every host;
* ``roundtrip``: a task on host 1 that takes host 0's object and returns it
  (a new object in host 1's store), then a task on host 0 that takes that one.

The time runs from submitting the tasks to the driver's ``ray.get`` of their
small answers (fingerprints, which are checked). Rep 0 is cold.

Needs ``pip install ray`` (``pip install -e '.[peers]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
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

OBJECT_STORE_BYTES = 2_500_000_000  # an allgather of 8 x 256 MiB needs 2.15 GB per host
PORT = 6379


def available() -> tuple[bool, str]:
    try:
        import ray  # noqa: F401
    except ImportError as e:
        return False, f"ray not installed ({e}); pip install ray"
    if _ray_cli() is None:
        return False, "the 'ray' command is not on PATH"
    return True, ""


def _ray_cli() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "ray")
    return here if os.path.exists(here) else shutil.which("ray")


# ------------------------------------------------------------ cluster


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        "OMP_NUM_THREADS": "1",
    }


def start(ec: Any, tmp: str) -> str:
    """Start Ray on every host; the GCS address."""
    ray = _ray_cli()
    assert ray is not None
    head = ec.hosts["sched"].address
    common = ["--disable-usage-stats", "--object-store-memory", str(OBJECT_STORE_BYTES)]
    common += ["--temp-dir", tmp]
    cmds = [
        (
            "sched",
            [ray, "start", "--head", "--node-ip-address", head, "--port", str(PORT)]
            + ["--num-cpus", "0", "--include-dashboard=false", *common],
        )
    ]
    for i in range(ec.n_workers):
        role = f"w{i}"
        cmds.append(
            (
                role,
                [ray, "start", "--address", f"{head}:{PORT}"]
                + ["--node-ip-address", ec.hosts[role].address, "--num-cpus", "1"]
                + ["--resources", json.dumps({role: 1}), *common],
            )
        )
    for role, argv in cmds:
        r = subprocess.run(
            [*ec.exec_prefix(role), *argv], capture_output=True, text=True, env=_env(), timeout=180
        )
        if r.returncode != 0:
            raise RuntimeError(f"ray start on {role} failed: {(r.stderr or r.stdout)[-2000:]}")
    return f"{head}:{PORT}"


def stop(ec: Any) -> None:
    """Kill every process left in the cluster's namespaces (Ray's daemons)."""
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for h in ec.hosts.values():
            r = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True)
            for pid in r.stdout.split():
                if pid.isdigit() and int(pid) != me:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), sig)
        time.sleep(2 if sig == signal.SIGTERM else 0.5)
    for h in ec.hosts.values():
        for p in h.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        h.procs.clear()


# ------------------------------------------------------------ driver


def _tasks() -> dict[str, Any]:
    import numpy as np
    import ray

    @ray.remote
    def make(nbytes: int, value: float) -> np.ndarray:
        return np.full(nbytes // 8, float(value))

    @ray.remote
    def fp(*xs: np.ndarray) -> list[tuple[int, float, float]]:
        return [(int(x.size), float(x[0]), float(x[-1])) for x in xs]

    @ray.remote
    def add_all(*xs: np.ndarray) -> np.ndarray:
        out = xs[0].copy()
        for x in xs[1:]:
            out += x
        return out

    @ray.remote
    def echo(x: np.ndarray) -> np.ndarray:
        return x

    return {"make": make, "fp": fp, "add_all": add_all, "echo": echo}


def _one_rep(t: dict[str, Any], op: str, size: int, n: int, rep: int, timeout: float):
    """(seconds, ok) of one rep of ``op``."""
    import ray

    def on(task: Any, i: int) -> Any:
        return task.options(resources={f"w{i}": 0.01})

    count = size // 8
    total = n * (n + 1) / 2
    if op in ("broadcast", "roundtrip"):
        xs = [on(t["make"], 0).remote(size, rep + 1)]
    else:
        xs = [on(t["make"], i).remote(size, i + 1) for i in range(n)]
    ray.wait(xs, num_returns=len(xs), fetch_local=False, timeout=timeout)
    t0 = time.perf_counter()
    if op == "broadcast":
        outs = [on(t["fp"], i).remote(xs[0]) for i in range(1, n)]
        want = [[(count, rep + 1, rep + 1)]] * (n - 1)
    elif op == "reduce":
        s = on(t["add_all"], 0).remote(*xs)
        ray.wait([s], fetch_local=False, timeout=timeout)
        dt = time.perf_counter() - t0
        return dt, ray.get(on(t["fp"], 0).remote(s), timeout=timeout) == [(count, total, total)]
    elif op == "allreduce":
        s = on(t["add_all"], 0).remote(*xs)
        outs = [on(t["fp"], i).remote(s) for i in range(n)]
        want = [[(count, total, total)]] * n
    elif op in ("gather", "allgather"):
        outs = [on(t["fp"], i).remote(*xs) for i in range(1 if op == "gather" else n)]
        want = [[(count, i + 1, i + 1) for i in range(n)]] * len(outs)
    else:  # roundtrip
        y = on(t["echo"], 1).remote(xs[0])
        outs = [on(t["fp"], 0).remote(y)]
        want = [[(count, rep + 1, rep + 1)]]
    got = ray.get(outs, timeout=timeout)
    return time.perf_counter() - t0, got == want


def driver_main(address: str, grid: list, reps: int, n: int, rate: float) -> int:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    t = _tasks()
    for size, ops in grid:
        for op in ops:
            timeout = 60 + 20 * bound_seconds(op, n, size, rate)
            times, ok, note = [], True, ""
            for rep in range(reps + 1):
                try:
                    dt, good = _one_rep(t, op, size, n, rep, timeout)
                except Exception as e:  # noqa: BLE001 - reported in the table
                    times.append(float("inf"))
                    ok, note = False, f"{type(e).__name__}: {str(e)[:120]}"
                    break
                times.append(dt)
                ok = ok and good
                time.sleep(0.3)  # let Ray free the rep's objects
            d = {"op": op, "size": size, "times": times, "ok": ok, "note": note}
            print(mark(json.dumps(d)), flush=True)
    ray.shutdown()
    return 0


# ------------------------------------------------------------ launcher


def run(ec: Any, grid: Sequence[tuple[int, Sequence[str]]], reps: int) -> list[Measured]:
    """Start Ray on ``ec``, run the (size, operations) pairs of ``grid``, stop Ray."""
    n = ec.n_workers
    ok, why = available()
    if not ok:
        return [
            Measured("ray", op, s, n, available=False, note=why) for s, ops in grid for op in ops
        ]
    tmp = tempfile.mkdtemp(prefix="hplray")
    out, why = "", ""
    try:
        address = start(ec, tmp)
        argv = [sys.executable, os.path.abspath(__file__), "--driver", "--address", address]
        argv += ["--n", str(n), "--reps", str(reps), "--rate", str(ec.rate_bytes_per_s)]
        argv += ["--grid", json.dumps([[s, list(ops)] for s, ops in grid])]
        est = sum(bound_seconds(op, n, s, ec.rate_bytes_per_s) for s, ops in grid for op in ops)
        timeout = 300 + 10 * est * (reps + 1)
        log = os.path.join(tmp, "driver.log")
        with open(log, "w") as f:
            driver = subprocess.Popen(
                [*ec.exec_prefix("sched"), *argv],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=_env(),
                start_new_session=True,
            )
        why = wait_watched([driver], timeout)
        with open(log) as f:
            out = f.read()
        if not why and driver.returncode:
            why = f"driver exited {driver.returncode}"
        if why:
            print(f"# ray driver: {why}; its output:\n{out[-3000:]}", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the table
        why = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        stop(ec)
        shutil.rmtree(tmp, ignore_errors=True)
    got = {(d["op"], d["size"]): d for d in map(json.loads, unmark(out))}
    rows = []
    for size, ops in grid:
        for op in ops:
            d = got.get((op, size))
            if d is None:
                rows.append(Measured("ray", op, size, n, [float("inf")], False, why or "no result"))
            else:
                note = d["note"] or ("" if d["ok"] else "WRONG RESULT")
                rows.append(Measured("ray", op, size, n, d["times"], d["ok"], note))
            print(f"# ray {op} {size}: {rows[-1].all_seconds} {rows[-1].note}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--driver", action="store_true", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--grid", required=True, help="JSON [[size, [operations]], ...]")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--rate", type=float, required=True, help="NIC bytes/s")
    args = p.parse_args(argv)
    return driver_main(args.address, json.loads(args.grid), args.reps, args.n, args.rate)


if __name__ == "__main__":
    sys.exit(main())
