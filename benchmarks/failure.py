"""Collectives with a worker killed mid-transfer, on an emulated cluster.

Scenarios (N worker hosts, objects of S bytes, per-host bandwidth B):

* ``broadcast-relay``   x (a task's result) on w0, one consumer on each other
  worker, asked for in host order so that hoplite forms the chain
  w0 -> w1 -> w2 -> ...; w1, the first relay, is SIGKILLed when half of S/B
  has passed. Hoplite's receivers below it resume from the byte they reached
  from another holder. Goal: within 2 S/B.
* ``broadcast-source``  the same, killing w0, the only complete copy: x is
  recomputed from its task (deterministic, so the partial copies resume; the
  recompute time is measured alone and reported). Goal: recompute + 1.5 S/B.
* ``broadcast-ranges``  like ``broadcast-relay``, but every consumer is
  submitted at once (one graph, as ``dask_hoplite.broadcast`` does), so that
  the directory may split x into byte ranges (``hoplite.broadcast.ranges``);
  w1, an inner node of the first range's tree, is SIGKILLed at half of S/B
  and the receivers below it resume that range from the byte they reached.
* ``broadcast-retire``  like ``broadcast-relay``, but w1 is retired with
  ``client.retire_workers`` instead of killed: nothing may be lost and the
  receivers below it resume rather than restart.
* ``reduce``            the sum of N inputs (one task each, one per worker),
  killing a worker that is not the root's at half of S/B; the lost input is
  recomputed, and a node replaces the dead one where its parent's stream
  broke (the rest of the tree keeps its partial results). Goal: recompute + 2 S/B.
* ``reduce-parts``      the same reduction in 2 segments, each up its own
  tree (``parts=2``); w1 is an inner node of the first tree and a leaf of the
  second: each tree repairs its dead node (spreads it by default,
  ``--repairs``). Goal: recompute + 2 S/B.

Each scenario runs without failure too, with hoplite and with Dask's default
(no plugin), on a fresh Dask cluster every time. Times are from the first
request to the last surviving result; the results are checked.

    python benchmarks/failure.py --workers 8 --rate-mbit 1000 --size 256MiB

With ``--warm K``, each scenario instead runs on one cluster, K kills in a
row, each after a failure-free repetition (:mod:`benchmarks.failure_warm`):

    python benchmarks/failure.py --warm 5 --workers 8 --rate-mbit 250 --size 64MiB
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks.emulation import EmulatedCluster  # noqa: E402
from benchmarks.failure_warm import OBJECTS, WarmScenario, print_warm, run_warm  # noqa: E402
from dask_hoplite.config import REDUCE_REPAIRS, resolve_repair  # noqa: E402

SCENARIOS = (
    "broadcast-relay",
    "broadcast-source",
    "reduce",
    "broadcast-retire",
    "reduce-parts",
    "broadcast-ranges",
)
METHODS = ("hoplite", "dask")

# Runs inside the scheduler host's namespace: prints START when the
# collective has been requested, then one JSON line with the outcome.
CLIENT = r"""
import json, sys, time
import numpy as np
from distributed import Client, wait
from dask_hoplite.compat import worker_addresses

addr, method, scenario, size, n, stagger, retire_after = sys.argv[1:8]
size, n, stagger, retire_after = int(size), int(n), float(stagger), float(retire_after)

OBJECTS_SOURCE

c = Client(addr, timeout=60)
c.wait_for_workers(n, timeout=60)
if method == "hoplite":
    import dask_hoplite
    c.register_plugin(dask_hoplite.Hoplite())
ws = sorted(worker_addresses(c), key=lambda a: HOSTS.index(a.split("//")[1].rsplit(":", 1)[0]))
out = {}
if scenario.startswith("broadcast"):
    t = time.perf_counter()
    x = c.submit(make, size, 1, workers=[ws[0]], allow_other_workers=True, pure=False)
    wait(x)
    out["compute"] = time.perf_counter() - t
    expected = c.submit(fingerprint, x, workers=[ws[0]], pure=False).result()
    print("START", flush=True)
    t0 = time.perf_counter()
    retiring = scenario == "broadcast-retire" and retire_after < 1e8
    if retiring:
        import threading
        def retire():
            time.sleep(retire_after)
            out["retired"] = list(c.retire_workers([ws[1]], close_workers=True))
        retirer = threading.Thread(target=retire)
        retirer.start()
    consumers = []
    if scenario == "broadcast-ranges":
        import dask
        from dask import delayed
        for w in ws[1:]:
            with dask.annotate(workers=[w], allow_other_workers=True):
                consumers.append(delayed(fingerprint, pure=False)(x))
        consumers = c.compute(consumers, optimize_graph=False)
    for w in ws[1:] if scenario != "broadcast-ranges" else ():
        consumers.append(
            c.submit(fingerprint, x, workers=[w], allow_other_workers=True, pure=False)
        )
        time.sleep(stagger)
    victim = 0 if scenario == "broadcast-source" else 1
    # a retired worker's consumer runs elsewhere; a killed one's is lost with it
    survivors = [
        f for f, w in zip(consumers, ws[1:]) if w != ws[victim] or scenario == "broadcast-retire"
    ]
    wait(survivors, timeout=900)
    out["time"] = time.perf_counter() - t0
    if retiring:
        retirer.join()
    got = c.gather(survivors)
    out["ok"] = all(g == expected for g in got)
else:
    inputs = [c.submit(make, size, i, workers=[w], allow_other_workers=True, pure=False)
              for i, w in enumerate(ws)]
    wait(inputs)
    t = time.perf_counter()
    wait(c.submit(make, size, 99, workers=[ws[-1]], pure=False))
    out["compute"] = time.perf_counter() - t
    expected = sum(make(size, i) for i in range(len(ws)))
    print("START", flush=True)
    t0 = time.perf_counter()
    if method == "hoplite":
        import dask_hoplite as dh
        # None: hoplite.reduce.parts, as a user's call would have it
        total = dh.reduce(inputs, "sum", parts=REDUCE_PARTS if scenario == "reduce-parts" else None)
    else:
        total = c.submit(lambda *xs: sum(xs), *inputs, workers=[ws[0]], pure=False)
    wait(total, timeout=900)
    out["time"] = time.perf_counter() - t0
    out["ok"] = bool(np.allclose(total.result(), expected))
if method == "hoplite":
    stats = c.run(lambda dask_worker: dict(dask_worker.plugins["hoplite-worker"].stats))
    out["resumes"] = sum(s.get("resumes", 0) for s in stats.values())
    out["restarts"] = sum(s.get("restarts", 0) for s in stats.values())
    out["bytes_resumed"] = sum(s.get("bytes-resumed", 0) for s in stats.values())
    out["tree_repairs"] = sum(s.get("reduce-repairs", 0) for s in stats.values())
    out["tree_restarts"] = sum(s.get("reduce-restarts", 0) for s in stats.values())
    out["adopted"] = sum(s.get("partial-copies-adopted", 0) for s in stats.values())
    out["ranged"] = sum(s.get("keys-received-in-ranges", 0) for s in stats.values())
    events = [e for _, e in c.get_events("hoplite")]
    out["events"] = sorted({e["action"] for e in events})
    out["spreads"] = [
        {k: e[k] for k in ("slot", "merged_into", "merged_from", "adopters", "patch_bytes")}
        for e in events
        if e["action"] == "reduce-spread"
    ]
    out["refusals"] = sorted(
        {e.get("reason", "") for e in events if e["action"] == "requests-refused"}
    )
print(json.dumps(out), flush=True)
"""


@dataclass
class Outcome:
    scenario: str
    method: str
    killed: bool
    n: int
    size: int
    rate_mbit: float
    time: float
    compute: float
    bound: float
    ok: bool
    resumes: int = 0
    restarts: int = 0
    note: str = ""
    bytes_resumed: int = 0  # bytes receivers already had when their stream resumed
    tree_repairs: int = 0  # reduce-tree nodes replaced where they died (tree kept)
    tree_restarts: int = 0  # reduce trees restarted from scratch
    adopted: int = 0  # partial copies completed by a recomputation on their worker
    events: tuple[str, ...] = ()  # the actions of client.get_events("hoplite")
    #: Each reduce node spread: slot, node that took its input and from which
    #: byte, {child: adopter}, patches its parent read.
    spreads: tuple[dict, ...] = ()
    repair: str = ""  # hoplite.reduce.repair, where set
    parts: int = 0  # the segments of reduce-parts
    #: Why workers refused stream requests (a refusal can restart a tree).
    refusals: tuple[str, ...] = ()
    #: Receivers that fetched the key in byte ranges.
    ranged: int = 0
    #: Bytes the victim's NIC received while the scenario ran: a worker that
    #: retires or dies stops taking its sender's upload.
    victim_rx_bytes: int = 0

    @property
    def x_bound(self) -> float:
        return self.time / self.bound


def victim_of(scenario: str) -> str:
    return {
        "broadcast-relay": "w1",
        "broadcast-source": "w0",
        "reduce": "w1",
        "reduce-parts": "w1",
        "broadcast-retire": "w1",
        "broadcast-ranges": "w1",
    }[scenario]


def _repair_used(scenario: str, method: str, setting: str) -> str:
    """The repair a reduce scenario ran with under ``hoplite.reduce.repair``
    ``setting``; "" where none."""
    if method != "hoplite" or not scenario.startswith("reduce"):
        return ""
    return resolve_repair(setting, in_parts=scenario == "reduce-parts")


def run_one(
    ec: EmulatedCluster,
    scenario: str,
    method: str,
    size: int,
    kill: bool,
    kill_after: float | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 1200,
    log_dir: str | None = None,
    parts: int = 2,
) -> Outcome:
    """One scenario on a fresh Dask cluster; ``kill``: SIGKILL the victim
    ``kill_after`` seconds after the collective was requested (default: half
    of S/B). ``parts``: the segments of ``reduce-parts``."""
    bound = size / ec.rate_bytes_per_s
    ec.start_dask(env=env, log_dir=log_dir)
    hosts = [ec.hosts[f"w{i}"].address for i in range(ec.n_workers)]
    code = (
        CLIENT.replace("HOSTS", repr(hosts))
        .replace("REDUCE_PARTS", str(parts))
        .replace("OBJECTS_SOURCE", OBJECTS)
    )
    stagger = min(0.2, 0.02 * bound)
    victim = victim_of(scenario)
    rx0 = ec.nic_bytes(victim)[1]
    p = subprocess.Popen(
        [
            *ec.exec_prefix("sched"),
            sys.executable,
            "-c",
            code,
            str(ec.scheduler_address),
            method,
            scenario,
            str(size),
            str(ec.n_workers),
            str(stagger),
            str((bound / 2 if kill_after is None else kill_after) if kill else 1e9),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    note = ""
    victim_rx = 0
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "START":
            raise RuntimeError(f"client did not start: {line!r} {p.stderr.read()[-3000:]}")
        if kill and scenario != "broadcast-retire":  # the client retires w1 itself
            time.sleep(bound / 2 if kill_after is None else kill_after)
            ec.signal(victim, signal.SIGKILL)
        out_s, err_s = p.communicate(timeout=timeout)
        victim_rx = ec.nic_bytes(victim)[1] - rx0
        if p.returncode != 0:
            raise RuntimeError(f"client failed ({p.returncode}): {err_s[-3000:]}")
        out = json.loads(out_s.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        p.kill()
        out, note = {"time": float("inf"), "ok": False, "compute": 0.0}, "HUNG"
    finally:
        if p.poll() is None:
            p.kill()
        ec.stop_dask()
    return Outcome(
        scenario,
        method,
        kill,
        ec.n_workers,
        size,
        ec.rate_mbit,
        out["time"],
        out.get("compute", 0.0),
        bound,
        bool(out["ok"]),
        int(out.get("resumes", 0)),
        int(out.get("restarts", 0)),
        note or ("" if out["ok"] else "WRONG RESULT"),
        int(out.get("bytes_resumed", 0)),
        int(out.get("tree_repairs", 0)),
        int(out.get("tree_restarts", 0)),
        int(out.get("adopted", 0)),
        tuple(out.get("events", ())),
        tuple(out.get("spreads", ())),
        _repair_used(scenario, method, (env or {}).get("DASK_HOPLITE__REDUCE__REPAIR", "")),
        parts if scenario == "reduce-parts" else 0,
        tuple(out.get("refusals", ())),
        int(out.get("ranged", 0)),
        victim_rx,
    )


def goal(o: Outcome) -> str:
    if not o.killed:
        return ""
    if o.scenario in ("broadcast-relay", "broadcast-retire", "broadcast-ranges"):
        return f"<= 2.00 S/B: {'yes' if o.time <= 2 * o.bound else 'NO'}"
    if o.scenario == "broadcast-source":
        ok = o.time <= o.compute + 1.5 * o.bound
        return f"<= recompute + 1.5 S/B: {'yes' if ok else 'NO'}"
    ok = o.time <= o.compute + 2 * o.bound
    return f"<= recompute + 2 S/B: {'yes' if ok else 'NO'}"


def print_table(results: list[Outcome]) -> None:
    print(
        f"{'scenario':18} {'parts':>5} {'method':8} {'repair':8} {'killed':6} {'time s':>8} "
        f"{'x S/B':>7} {'recompute s':>11} {'resumes':>7} {'restarts':>8} {'repairs':>7}  goal"
    )
    for o in results:
        print(
            f"{o.scenario:18} {o.parts or '':>5} {o.method:8} {o.repair:8} "
            f"{'yes' if o.killed else 'no':6} {o.time:8.2f} "
            f"{o.x_bound:7.2f} {o.compute:11.2f} {o.resumes:7d} {o.restarts:8d} {o.tree_repairs:7d}  "
            f"{goal(o)} {o.note}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rate-mbit", type=float, default=1000)
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--stall-timeout", default="10s", help="hoplite.stall-timeout")
    ap.add_argument(
        "--parts", type=int, nargs="+", default=[2], help="segments of reduce-parts, each in turn"
    )
    ap.add_argument("--reps", type=int, default=1, help="runs of each configuration")
    ap.add_argument("--name", help="result file name (default failure-n<workers>-<size>)")
    ap.add_argument(
        "--repairs",
        nargs="+",
        default=["auto"],
        choices=REDUCE_REPAIRS,
        help="hoplite.reduce.repair for the reduce scenarios, each in turn (auto, the "
        "default: spread in a reduce in parts, replace in one tree)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument(
        "--warm", type=int, default=0, help="K: each scenario on one cluster, K kills in a row"
    )
    ap.add_argument(
        "--pythonpath",
        nargs="+",
        default=[""],
        help="with --warm: run on the dask_hoplite in each directory in turn, alternately "
        "('' : the installed one; run from outside the checkout, or the current "
        "directory's dask_hoplite comes first)",
    )
    args = ap.parse_args(argv)
    size = parse_bytes(args.size)
    env = {"DASK_HOPLITE__STALL_TIMEOUT": args.stall_timeout}
    if args.warm:
        return _main_warm(args, size, env)
    results: list[Outcome] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        for scenario in args.scenarios:
            reduce = scenario.startswith("reduce")
            for parts in args.parts if scenario == "reduce-parts" else [2]:
                for method in args.methods:
                    repairs = args.repairs if reduce and method == "hoplite" else ["auto"]
                    for kill in (False, True):
                        for _ in range(args.reps):
                            for repair in repairs if kill else repairs[:1]:
                                run_env = {**env, "DASK_HOPLITE__REDUCE__REPAIR": repair}
                                o = run_one(
                                    ec, scenario, method, size, kill, env=run_env, parts=parts
                                )
                                results.append(o)
                                print_table([o])
    print()
    print(f"N={args.workers}, {args.rate_mbit:g} Mbit/s, S={format_bytes(size)}")
    print_table(results)
    os.makedirs(args.out, exist_ok=True)
    name = f"failure-n{args.workers}-{args.size}"
    path = os.path.join(args.out, (args.name or name) + ".json")
    with open(path, "w") as f:
        json.dump([asdict(o) for o in results], f, indent=1)
    print(f"wrote {path}")
    return 0 if all(o.ok for o in results) else 1


def _main_warm(args: argparse.Namespace, size: int, env: dict[str, str]) -> int:
    results: list[WarmScenario] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        for scenario in args.scenarios:
            for method in args.methods:
                for path in args.pythonpath:
                    run_env = {**env, **({"PYTHONPATH": path} if path else {})}
                    r = run_warm(
                        ec,
                        scenario,
                        method,
                        size,
                        args.warm,
                        victim_of(scenario),
                        env=run_env,
                        parts=args.parts[0],
                    )
                    results.append(r)
                    print_warm([r])
    print()
    print(f"N={args.workers}, {args.rate_mbit:g} Mbit/s, S={format_bytes(size)}, warm")
    print_warm(results)
    os.makedirs(args.out, exist_ok=True)
    name = args.name or f"failure-warm-n{args.workers}-{args.size}"
    path = os.path.join(args.out, name + ".json")
    with open(path, "w") as f:
        json.dump([asdict(r) for r in results], f, indent=1)
    print(f"wrote {path}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
