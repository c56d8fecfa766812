"""Dask and dask-hoplite for the peers benchmark: the public collectives of
``dask_hoplite`` on futures, with the plugin registered (``hoplite``) and
without it (``dask``: every call then runs the way Dask alone does it, a
reduction is one task on the first input's worker and the other outputs fetch
its result; see ``dask_hoplite/worker/planned_outputs.py``).

One Dask cluster per system: a scheduler on the ``sched`` host, one worker
process (one thread) per worker host, the client in this process (which must
have entered the ``sched`` namespace). Objects of S bytes (float64 arrays) are
made by one task per worker beforehand (not timed), then:

* ``broadcast``: ``dh.broadcast(x, workers=others)`` from worker 0;
* ``reduce``: ``dh.reduce(xs, "sum")``;
* ``allreduce``: ``dh.allreduce(xs, "sum")``;
* ``gather``: ``dh.gather(xs, to=worker 0)``;
* ``allgather``: ``dh.allgather(xs)``;
* ``roundtrip``: a task pinned to worker 1 that takes worker 0's object and
  returns it, then a task pinned to worker 0 that takes that result.

The time runs from the call to ``wait`` on the returned futures; the results
are checked (fingerprints) afterwards. Rep 0 is cold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.peers_common import Measured, bound_seconds


def make_input(nbytes: int, value: float) -> np.ndarray:
    return np.full(nbytes // 8, float(value))


def echo(x: np.ndarray) -> np.ndarray:
    return x


def fingerprint(x: Any) -> list[tuple[int, float, float]]:
    xs = x if isinstance(x, list) else [x]
    return [(int(a.size), float(a[0]), float(a[-1])) for a in xs]


def _one_rep(client: Any, workers: list[str], op: str, size: int, rep: int, timeout: float):
    """(seconds, ok) of one rep of ``op``."""
    from distributed import wait

    import dask_hoplite as dh

    n = len(workers)
    count = size // 8
    total = n * (n + 1) / 2
    if op in ("broadcast", "roundtrip"):
        xs = [client.submit(make_input, size, rep + 1, workers=[workers[0]], pure=False)]
    else:
        xs = [
            client.submit(make_input, size, i + 1, workers=[w], pure=False)
            for i, w in enumerate(workers)
        ]
    wait(xs, timeout=timeout)
    t0 = time.perf_counter()
    if op == "broadcast":
        outs = dh.broadcast(xs[0], workers=workers[1:])
        want = [[(count, rep + 1, rep + 1)]] * (n - 1)
    elif op == "reduce":
        outs = [dh.reduce(xs, "sum")]
        want = [[(count, total, total)]]
    elif op == "allreduce":
        outs = dh.allreduce(xs, "sum")
        want = [[(count, total, total)]] * n
    elif op == "gather":
        outs = [dh.gather(xs, to=workers[0])]
        want = [[(count, i + 1, i + 1) for i in range(n)]]
    elif op == "allgather":
        outs = dh.allgather(xs)
        want = [[(count, i + 1, i + 1) for i in range(n)]] * n
    else:  # roundtrip
        y = client.submit(echo, xs[0], workers=[workers[1]], pure=False)
        outs = [client.submit(echo, y, workers=[workers[0]], pure=False)]
        want = [[(count, rep + 1, rep + 1)]]
    wait(outs, timeout=timeout)
    dt = time.perf_counter() - t0
    # Check each result where it lies (a check task goes to the holder).
    checks = [client.submit(fingerprint, f, pure=False) for f in outs]
    got = [list(map(tuple, g)) for g in client.gather(checks)]
    ok = len(got) == len(want) and got == want
    del xs, outs, checks
    return dt, ok


def run(
    ec: Any, system: str, grid: Sequence[tuple[int, Sequence[str]]], reps: int
) -> list[Measured]:
    """``system`` is "dask" or "hoplite"; ``grid`` is (size, operations) pairs.
    One Dask cluster for all of them."""
    from distributed import Client

    import dask_hoplite as dh

    n = ec.n_workers
    rows: list[Measured] = []
    ec.start_dask(env={"DASK_DISTRIBUTED__WORKER__DAEMON": "False"})
    try:
        with Client(ec.scheduler_address, timeout=60) as client:
            if system == "hoplite":
                client.register_plugin(dh.Hoplite())
            workers = ec.worker_addresses(client)
            for size, ops in grid:
                for op in ops:
                    timeout = 60 + 20 * bound_seconds(op, n, size, ec.rate_bytes_per_s)
                    m = Measured(system, op, size, n)
                    for rep in range(reps + 1):
                        try:
                            dt, good = _one_rep(client, workers, op, size, rep, timeout)
                        except Exception as e:  # noqa: BLE001 - reported in the table
                            m.all_seconds.append(float("inf"))
                            m.ok, m.note = False, f"{type(e).__name__}: {str(e)[:120]}"
                            break
                        m.all_seconds.append(dt)
                        if not good:
                            m.ok, m.note = False, "WRONG RESULT"
                        time.sleep(0.3)
                    print(f"# {system} {op} {size}: {m.all_seconds} {m.note}", flush=True)
                    rows.append(m)
    finally:
        ec.stop_dask()
    return rows
