"""Failures measured warm: one cluster per scenario, several kills in a row.

:mod:`benchmarks.failure` times each kill on a fresh cluster, where the
first collective's start-up costs hide in the figure. Here a scenario runs on
one cluster, ``--kills`` times (at least 5 for issue 41):

1. every worker is up (the victim restarted after the previous kill, with the
   same name on the same host);
2. one failure-free repetition of the collective runs;
3. the recompute's own time is measured: the time of the task that makes one
   input (broadcast source, reduce input) on an idle worker;
4. the same collective runs again, and the victim is killed (``SIGKILL``)
   half of S/B after the request, or retired (``broadcast-retire``).

Each kill is reported as a ratio of its time to (the failure-free time just
before it + the recompute's own time, counted where the victim held an input
that must be made again: ``broadcast-source``, ``reduce``, ``reduce-parts``).
Times run from the request to the last surviving result, every result
checked. The scenarios and victims are :mod:`benchmarks.failure`'s.

    python benchmarks/failure.py --warm 5 --workers 8 --rate-mbit 250 --size 64MiB

``--pythonpath DIR`` runs the cluster and its client on the dask_hoplite in
``DIR`` (a checkout of an earlier commit), to compare two versions
alternately in one sitting.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from benchmarks.broadcast import quantile
from benchmarks.emulation import EmulatedCluster

#: Scenarios whose victim holds an input that is made again after the kill.
RECOMPUTED = ("broadcast-source", "reduce", "reduce-parts")

#: What the client scripts (here and :mod:`benchmarks.failure`) make and
#: check, as source: they run as ``python -c``, so their tasks' functions
#: travel to the workers by value.
OBJECTS = r"""
def make(nbytes, seed):
    return np.random.default_rng(seed).random(nbytes // 8)

def fingerprint(x):
    x = np.asarray(x)
    return [int(x.size), float(x[:: max(1, x.size // 4096)].sum())]
"""

# Runs inside the scheduler host's namespace. For each kill: prints one JSON
# line for the failure-free run, then KILL when the killed run's collective
# is requested, then its JSON line, then waits for GO on stdin (the driver
# has restarted the victim).
CLIENT = r"""
import json, sys, threading, time
import numpy as np
from distributed import Client, wait
from dask_hoplite.compat import worker_addresses

addr, method, scenario, size, n, kills, stagger, retire_after, parts = sys.argv[1:10]
size, n, kills = int(size), int(n), int(kills)
stagger, retire_after, parts = float(stagger), float(retire_after), int(parts)
HOSTS = HOSTS_LIST

OBJECTS_SOURCE

c = Client(addr, timeout=60)
code = ""
if method == "hoplite":
    import dask_hoplite as dh
    c.register_plugin(dh.Hoplite())
    code = dh.__file__

def workers():
    c.wait_for_workers(n, timeout=120)
    ws = worker_addresses(c)
    return sorted(ws, key=lambda a: HOSTS.index(a.split("//")[1].rsplit(":", 1)[0]))

def recompute_time(ws, seed):
    t = time.perf_counter()
    wait(c.submit(make, size, seed, workers=[ws[-1]], pure=False))
    return time.perf_counter() - t

def broadcast(ws, seed, killed):
    x = c.submit(make, size, seed, workers=[ws[0]], allow_other_workers=True, pure=False)
    expected = c.submit(fingerprint, x, workers=[ws[0]], pure=False).result()
    if killed:
        print("KILL", flush=True)
    t0 = time.perf_counter()
    retirer = None
    if killed and scenario == "broadcast-retire":
        def retire():
            time.sleep(retire_after)
            c.retire_workers([ws[1]], close_workers=True)
        retirer = threading.Thread(target=retire)
        retirer.start()
    consumers = []
    for w in ws[1:]:
        consumers.append(
            c.submit(fingerprint, x, workers=[w], allow_other_workers=True, pure=False)
        )
        time.sleep(stagger)
    victim = 0 if scenario == "broadcast-source" else 1
    survivors = [
        f for f, w in zip(consumers, ws[1:])
        if not killed or w != ws[victim] or scenario == "broadcast-retire"
    ]
    wait(survivors, timeout=900)
    elapsed = time.perf_counter() - t0
    if retirer is not None:
        retirer.join()
    ok = all(g == expected for g in c.gather(survivors))
    return elapsed, ok

def reduce(ws, seed, killed):
    inputs = [c.submit(make, size, seed + i, workers=[w], allow_other_workers=True, pure=False)
              for i, w in enumerate(ws)]
    wait(inputs)
    expected = sum(make(size, seed + i) for i in range(len(ws)))
    if killed:
        print("KILL", flush=True)
    t0 = time.perf_counter()
    if method == "hoplite":
        total = dh.reduce(inputs, "sum", parts=parts if scenario == "reduce-parts" else None)
    else:
        total = c.submit(lambda *xs: sum(xs), *inputs, workers=[ws[0]], pure=False)
    wait(total, timeout=900)
    elapsed = time.perf_counter() - t0
    return elapsed, bool(np.allclose(total.result(), expected))

run = broadcast if scenario.startswith("broadcast") else reduce
for i in range(kills):
    ws = workers()
    free, free_ok = run(ws, 1000 * i, False)
    compute = recompute_time(ws, 1000 * i + 999)
    print(json.dumps({"free": free, "free_ok": free_ok, "compute": compute, "code": code}),
          flush=True)
    since = time.time()
    killed, ok = run(ws, 1000 * i + 500, True)
    logged = [e for t, e in c.get_events("hoplite") if t >= since] if method == "hoplite" else []
    events = sorted({e["action"] for e in logged})
    # Where each spread put the lost input: the node whose worker Dask
    # recomputed it on (per segment tree, in the trees' order).
    spreads = sorted((e["rid"], e["merged_into"]) for e in logged if e["action"] == "reduce-spread")
    print(json.dumps({"killed": killed, "ok": ok, "events": events,
                      "merged_into": [m for _, m in spreads]}), flush=True)
    if sys.stdin.readline().strip() != "GO":
        break
"""


@dataclass
class Kill:
    """One kill: the failure-free time before it, the recompute's own time,
    the killed time, and whether every result was right."""

    free: float
    compute: float
    killed: float
    ok: bool
    #: The actions of the hoplite events logged during the killed run (what
    #: the kill set off: resumes, repairs, restarts).
    events: tuple[str, ...] = ()
    #: In a spread repair, the node of each segment tree that took the lost
    #: input: the one on the worker where Dask recomputed it. Drawn once per
    #: cluster, and the killed time depends on it, so two codes compare
    #: alike only on a like draw (or over many clusters).
    merged_into: tuple[int, ...] = ()

    def ratio(self, recomputed: bool) -> float:
        return self.killed / (self.free + (self.compute if recomputed else 0.0))


@dataclass
class WarmScenario:
    scenario: str
    method: str
    code: str  # "" for the installed dask_hoplite, else the --pythonpath given
    n: int
    size: int
    rate_mbit: float
    bound: float
    kills: list[Kill] = field(default_factory=list)
    note: str = ""
    #: The dask_hoplite the client imported (to check --pythonpath took).
    imported: str = ""

    @property
    def ratios(self) -> list[float]:
        return [k.ratio(self.scenario in RECOMPUTED) for k in self.kills]

    @property
    def ok(self) -> bool:
        return bool(self.kills) and all(k.ok for k in self.kills) and not self.note


def run_warm(
    ec: EmulatedCluster,
    scenario: str,
    method: str,
    size: int,
    kills: int,
    victim: str,
    env: dict[str, str] | None = None,
    parts: int = 2,
    timeout: float = 900,
    log_dir: str | None = None,
) -> WarmScenario:
    """``kills`` kills of ``scenario`` on one cluster (see the module's
    docstring); ``env``'s ``PYTHONPATH`` picks the dask_hoplite it runs."""
    bound = size / ec.rate_bytes_per_s
    env = env or {}
    out = WarmScenario(
        scenario, method, env.get("PYTHONPATH", ""), ec.n_workers, size, ec.rate_mbit, bound
    )
    ec.start_dask(env=env, log_dir=log_dir)
    hosts = [ec.hosts[f"w{i}"].address for i in range(ec.n_workers)]
    argv = [
        sys.executable,
        "-c",
        CLIENT.replace("HOSTS_LIST", repr(hosts)).replace("OBJECTS_SOURCE", OBJECTS),
        str(ec.scheduler_address),
        method,
        scenario,
        str(size),
        str(ec.n_workers),
        str(kills),
        str(min(0.2, 0.02 * bound)),
        str(bound / 2),
        str(parts),
    ]
    p = subprocess.Popen(
        [*ec.exec_prefix("sched"), *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    assert p.stdin is not None and p.stdout is not None
    deadline = time.monotonic() + timeout * kills

    def line() -> str:
        got = p.stdout.readline()  # type: ignore[union-attr]
        if not got:
            raise RuntimeError(f"client ended: {p.stderr.read()[-3000:]}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            raise TimeoutError("the scenario ran past its deadline")
        return got.strip()

    try:
        for _ in range(kills):
            free = json.loads(line())
            out.imported = free["code"]
            if line() != "KILL":
                raise RuntimeError("client out of step")
            if scenario != "broadcast-retire":  # the client retires the victim itself
                time.sleep(bound / 2)
                ec.signal(victim, signal.SIGKILL)
            killed = json.loads(line())
            out.kills.append(
                Kill(
                    free["free"],
                    free["compute"],
                    killed["killed"],
                    free["free_ok"] and killed["ok"],
                    tuple(killed["events"]),
                    tuple(killed.get("merged_into", ())),
                )
            )
            print(
                f"  {scenario} {method} kill {len(out.kills)}: free {free['free']:.2f}s "
                f"recompute {free['compute']:.2f}s killed {killed['killed']:.2f}s "
                f"ratio {out.ratios[-1]:.2f} ok {out.kills[-1].ok} {' '.join(killed['events'])}"
                + (f" input into {killed['merged_into']}" if killed.get("merged_into") else ""),
                flush=True,
            )
            _wait_gone(ec, victim)
            ec.start_workers(victim, env, log_dir=log_dir)
            p.stdin.write("GO\n")
            p.stdin.flush()
        p.stdin.close()
        p.wait(timeout=60)
    except (RuntimeError, TimeoutError, ValueError) as e:
        out.note = f"{type(e).__name__}: {e}"[:500]
    finally:
        if p.poll() is None:
            p.kill()
        ec.stop_dask()
    return out


def _wait_gone(ec: EmulatedCluster, role: str, timeout: float = 60) -> None:
    """Wait until host ``role``'s workers have exited (a retired worker
    closes itself)."""
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in ec.hosts[role].procs):
        if time.monotonic() > end:
            ec.signal(role, signal.SIGKILL)
            return
        time.sleep(0.1)


def print_warm(results: list[WarmScenario]) -> None:
    print(
        f"{'scenario':18} {'method':8} {'code':12} {'kills':>5} {'free p50':>8} "
        f"{'killed p50':>10} {'ratio p50':>9} {'p90':>6} {'max':>6}  ok"
    )
    for r in results:
        frees = [k.free for k in r.kills]
        killed = [k.killed for k in r.kills]
        print(
            f"{r.scenario:18} {r.method:8} {os.path.basename(r.code) or 'installed':12} "
            f"{len(r.kills):5d} {quantile(frees, 0.5):8.2f} {quantile(killed, 0.5):10.2f} "
            f"{quantile(r.ratios, 0.5):9.2f} {quantile(r.ratios, 0.9):6.2f} "
            f"{max(r.ratios, default=float('inf')):6.2f}  {r.ok} {r.note}"
        )
