"""MPI peers for the emulated-cluster benchmarks: mpi4py on Open MPI.

Runs mpi4py's buffer-based collectives (``Bcast``, ``Reduce`` with ``MPI.SUM``,
``Allreduce``, ``Gather``, ``Allgather``; and a round trip, ``Send``/``Recv``
from rank 0 to rank 1 and back) of S bytes of float64 on an ``EmulatedCluster``: one
rank per worker host (N ranks, rank i on host ``w{i}``), rank 0 the root, so
that ``broadcast.py`` and ``reduce.py`` can show Dask, hoplite and MPI side by
side with the same ratio to the physical bound.

Launch. ``mpirun`` runs inside the ``sched`` host's namespace with a hostfile
of the worker hosts' addresses (one slot each) and an rsh launcher agent (a
generated shell script: ``agent [options] <address> <command...>``) that maps
the address to its host's namespace and runs the command there with
``ip netns exec <ns> sh -c ...``. So every ``orted`` and every rank lives in
its host's namespace, and the daemons connect back to ``mpirun`` over the
emulated network. MCA settings (all variants):

* ``pml ob1``, ``btl tcp,self``: no shared memory (vader/sm) between ranks, every
  byte between two ranks crosses both hosts' rate-limited NICs;
* ``btl_tcp_if_include`` and ``oob_tcp_if_include`` = the cluster's /24;
* ``mpi_yield_when_idle 1`` and ``--bind-to none``: 8 ranks share 2 cores (every
  "node" reports the same 2 cores, so default binding would pin all ranks of
  all hosts to the same core), and waiting ranks must yield to working ones;
* ``plm_rsh_no_tree_spawn 1`` (``mpirun`` starts every daemon itself),
  ``orte_tmpdir_base`` in a private temporary directory removed afterwards.

Variants:

* ``mpi``: Open MPI's default collective selection (``coll tuned``'s fixed
  decision rules).
* ``mpi-tuned``: ``coll_tuned_use_dynamic_rules 1`` and forced algorithms for
  large messages on a bandwidth-bound network (numbering of Open MPI 4.1.4's
  ``ompi_info --param coll tuned --level 9``; picked by a trial at N=8,
  256 MiB, 1 Gbit/s, see docs/benchmark-log.md):
  ``TUNED_MCA`` below.

Timing. Before every rep all ranks meet in a ``Barrier``; each rank measures
its own time from leaving the barrier to the return of the collective
(``MPI.Wtime``); the rep's time is the **maximum over ranks**. Then a closing
``Barrier``, after which every rank reads its NIC counters (``/proc/net/dev``
in its namespace) and its CPU time. Rep 0 is the cold one (fresh connections,
like the Dask methods' first rep); ``seconds`` is the median of the warm reps.
Buffers are allocated once and touched before the first rep. Results are
checked (sampled elements) on every rank after every rep.

    python benchmarks/mpi_peers.py --workers 4 --size 64MiB --collectives bcast reduce
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

COLLECTIVES = ("bcast", "reduce", "allreduce", "gather", "allgather", "roundtrip")
VARIANTS = ("mpi", "mpi-tuned")

# Method names used by broadcast.py and reduce.py.
BROADCAST_METHODS = ("mpi", "mpi-tuned")
REDUCE_METHODS = (
    "mpi-reduce",
    "mpi-tuned-reduce",
    "mpi-allreduce",
    "mpi-tuned-allreduce",
    "mpi-gather",
    "mpi-tuned-gather",
)

# Forced algorithms for "mpi-tuned" (Open MPI 4.1 coll tuned numbering). Trial at
# N=8, 256 MiB, 1 Gbit/s (warm time / bound; default selection in brackets):
# bcast [7.3: root sends 7 S] pipeline 128K 2.5, 256K 1.09-1.12, 512K 1.17,
# 1M 1.3, 4M 1.3; chain fanout 1 1.16; scatter_allgather_ring 1.9.
# reduce [3.7: binomial, root receives 3 S] pipeline 256K 1.2, 512K 1.13, 1M 1.3,
# 2M 1.3 (+-0.1 run to run); rabenseifner: one run hit the launch hang, not retried.
# allreduce [1.8] ring 1.19, segmented ring (1M) 1.35, rabenseifner 1.8.
# gather [1.15] basic linear 1.06, linear with sync 1.05.
TUNED_MCA: dict[str, dict[str, str]] = {
    # 3 = pipeline (a chain of fanout 1) in 256 KiB segments: every NIC carries S
    # once, all links busy at once; smaller segments cost per-message overhead,
    # larger ones pipeline fill and burstiness through the tbf queues.
    "bcast": {
        "coll_tuned_bcast_algorithm": "3",
        "coll_tuned_bcast_algorithm_segmentsize": "262144",
    },
    # 3 = pipeline (chain) in 512 KiB segments: each rank receives, combines, forwards.
    "reduce": {
        "coll_tuned_reduce_algorithm": "3",
        "coll_tuned_reduce_algorithm_segmentsize": "524288",
    },
    # 4 = ring (reduce-scatter then allgather in S/N blocks): 2(N-1)/N S per NIC.
    "allreduce": {"coll_tuned_allreduce_algorithm": "4"},
    # 3 = linear with synchronization (1 MiB first segment): the root pulls one
    # rank at a time, so its ingress carries one stream at full rate instead of
    # N-1 competing ones.
    "gather": {
        "coll_tuned_gather_algorithm": "3",
        "coll_tuned_gather_algorithm_segmentsize": "1048576",
    },
    # 4 = ring: every NIC carries (N-1) S each way, the bound; not trial-picked.
    "allgather": {"coll_tuned_allgather_algorithm": "4"},
    "roundtrip": {},  # point to point: no collective algorithm to pick
}

_MARK = "HPLMPI "
_READY = "HPLMPI-READY"


def available() -> tuple[bool, str]:
    """Whether MPI peers can run here (mpi4py importable and ``mpirun`` on PATH)."""
    if shutil.which("mpirun") is None:
        return False, "mpirun not found (apt-get install openmpi-bin libopenmpi-dev)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False, "mpi4py not installed (pip install mpi4py)"
    return True, ""


def parse_method(method: str) -> tuple[str, str]:
    """``"mpi"`` -> (``"mpi"``, ``"bcast"``); ``"mpi-tuned-reduce"`` -> (``"mpi-tuned"``, ``"reduce"``)."""
    if method in VARIANTS:
        return method, "bcast"
    variant, _, collective = method.rpartition("-")
    if variant not in VARIANTS or collective not in COLLECTIVES:
        raise ValueError(f"not an MPI method: {method!r}")
    return variant, collective


def select_methods(
    requested: Sequence[str] | None, default: Sequence[str], mpi_methods: Sequence[str]
) -> list[str]:
    """The methods to run: ``requested``, or ``default`` plus the MPI methods
    when MPI is available. MPI methods are dropped, with a printed note, when
    mpi4py or mpirun is missing."""
    ok, why = available()
    if requested is None:
        if ok:
            return [*default, *mpi_methods]
        print(f"# note: MPI methods skipped: {why}", flush=True)
        return list(default)
    methods = list(requested)
    if not ok and any(m in mpi_methods for m in methods):
        skipped = [m for m in methods if m in mpi_methods]
        print(f"# note: skipping {' '.join(skipped)}: {why}", flush=True)
        methods = [m for m in methods if m not in mpi_methods]
    return methods


@dataclass
class MpiRun:
    variant: str
    collective: str
    n: int
    size: int
    all_seconds: list[float]  # max over ranks, per rep; rep 0 cold
    root_tx: list[int]  # root NIC egress per rep
    max_rx: list[int]  # largest NIC ingress of any rank per rep
    cpu_percent: list[float]  # all ranks' CPU time / time / cores, per rep
    ok: bool
    note: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        warm = self.all_seconds[1:] or self.all_seconds
        return statistics.median(warm) if warm else float("inf")

    @property
    def root_tx_bytes(self) -> int:
        return int(statistics.median(self.root_tx)) if self.root_tx else 0

    @property
    def max_rx_bytes(self) -> int:
        return int(statistics.median(self.max_rx)) if self.max_rx else 0

    @property
    def cpu(self) -> float:
        return statistics.median(self.cpu_percent) if self.cpu_percent else 0.0


_AGENT = """#!/bin/sh
# Open MPI rsh agent for an EmulatedCluster: agent [options] <host> <command...>
# runs <command...> inside <host>'s network namespace.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host="$1"; shift
case "$host" in
{cases}
  *) echo "mpi agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" /bin/sh -c "$*"
"""


def _mca(collective: str, variant: str, subnet: str, agent: str, tmp: str) -> list[tuple[str, str]]:
    cidr = f"{subnet}.0/24"
    mca = [
        ("plm_rsh_agent", agent),
        ("plm_rsh_no_tree_spawn", "1"),
        ("orte_tmpdir_base", tmp),
        ("pml", "ob1"),
        ("btl", "tcp,self"),
        ("btl_tcp_if_include", cidr),
        ("oob_tcp_if_include", cidr),
        ("mpi_yield_when_idle", "1"),
    ]
    if variant == "mpi-tuned":
        mca.append(("coll_tuned_use_dynamic_rules", "1"))
        mca += list(TUNED_MCA[collective].items())
    return mca


def _kill_leftovers(ec: Any) -> None:
    """Kill orted daemons and rank programs still inside the cluster's namespaces."""
    me = os.path.abspath(__file__)
    for h in ec.hosts.values():
        r = subprocess.run(["ip", "netns", "pids", h.netns], capture_output=True, text=True)
        for pid in r.stdout.split():
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "orted" in cmd or "mpirun" in cmd or me in cmd:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


def _mpirun(
    argv: list[str], cwd: str, launch_timeout: float, timeout: float
) -> tuple[str, str, str]:
    """Run mpirun; ("ok" | "failed" | "launch" | "timeout", stdout, stderr).
    "launch": rank 0 did not print its ready line within ``launch_timeout``."""
    p = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=cwd,
    )
    out: list[str] = []
    err: list[str] = []
    ready = threading.Event()

    def read_out() -> None:
        assert p.stdout is not None
        for ln in p.stdout:
            out.append(ln)
            if ln.startswith(_READY):
                ready.set()

    def read_err() -> None:
        assert p.stderr is not None
        err.extend(p.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in readers:
        t.start()
    t0 = time.monotonic()
    status = "ok"
    while p.poll() is None:
        if not ready.is_set() and time.monotonic() - t0 > launch_timeout:
            status = "launch"
        elif time.monotonic() - t0 > timeout:
            status = "timeout"
        if status != "ok":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    p.wait()
    for t in readers:
        t.join(timeout=10)
    if status == "ok" and p.returncode != 0:
        status = "failed"
    return status, "".join(out), "".join(err)


def run(
    ec: Any,
    collective: str,
    size: int,
    reps: int = 3,
    variant: str = "mpi",
    timeout: float | None = None,
    extra_mca: Sequence[tuple[str, str]] = (),
    launch_timeout: float = 30,
    launch_retries: int = 2,
) -> MpiRun:
    """Run one collective on ``ec``'s worker hosts (Dask should be stopped:
    the ranks need the CPU). ``reps`` warm reps follow one cold rep."""
    if collective not in COLLECTIVES or variant not in VARIANTS:
        raise ValueError(f"unknown collective/variant {collective!r}/{variant!r}")
    n = ec.n_workers
    bound = size / ec.rate_bytes_per_s * (n - 1 if collective.endswith("gather") else 2)
    if timeout is None:
        timeout = 60 + 20 * bound * (reps + 1)
    tmp = tempfile.mkdtemp(prefix="hplmpi")
    try:
        roles = [f"w{i}" for i in range(n)]
        hostfile = os.path.join(tmp, "hostfile")
        with open(hostfile, "w") as f:
            f.writelines(f"{ec.hosts[r].address} slots=1\n" for r in roles)
        agent = os.path.join(tmp, "agent.sh")
        cases = "\n".join(f'  {ec.hosts[r].address}) ns="{ec.hosts[r].netns}" ;;' for r in roles)
        with open(agent, "w") as f:
            f.write(_AGENT.format(cases=cases))
        os.chmod(agent, 0o755)
        # extra settings replace same-named ones (mpirun would join repeated keys)
        mca_d = dict(_mca(collective, variant, ec.subnet, agent, tmp))
        mca_d.update(dict(extra_mca))
        mca = list(mca_d.items())
        argv = [
            *ec.exec_prefix("sched"),
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "--map-by",
            "node",
            "-np",
            str(n),
            "--hostfile",
            hostfile,
        ]
        for k, v in mca:
            argv += ["--mca", k, v]
        argv += [
            sys.executable,
            os.path.abspath(__file__),
            "--rank-program",
            "--collective",
            collective,
            "--size",
            str(size),
            "--reps",
            str(reps),
        ]
        note = ""
        for attempt in range(1 + launch_retries):
            status, out, err = _mpirun(argv, tmp, launch_timeout, timeout)
            _kill_leftovers(ec)
            if status != "launch":
                break
            # Rarely (about 1 launch in 5 here) some orted daemons never report
            # back and mpirun waits forever; start again.
            print(
                f"# mpirun: ranks not up after {launch_timeout:.0f}s "
                f"(attempt {attempt + 1}), stderr: {err[-1000:]!r}",
                file=sys.stderr,
                flush=True,
            )
            note = f"launch retried {attempt + 1}x"
        line = next((ln for ln in out.splitlines() if ln.startswith(_MARK)), None)
        if status == "ok" and line is None:
            status = "failed"
        if status != "ok" or line is None:
            print(f"# mpirun {status}; its stderr:\n{err[-3000:]}", file=sys.stderr, flush=True)
            why = {
                "launch": "did not start",
                "timeout": f"did not finish in {timeout:.0f}s",
            }.get(status, "failed")
            return MpiRun(
                variant,
                collective,
                n,
                size,
                [float("inf")],
                [],
                [],
                [],
                False,
                f"mpirun {why}",
                argv,
            )
        data = json.loads(line[len(_MARK) :])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ncpu = os.cpu_count() or 1
    times, root_tx, max_rx, cpu = [], [], [], []
    ok = True
    for rows in data["reps"]:  # one row per rank: (seconds, rx, tx, cpu_s, ok)
        dt = max(r[0] for r in rows)
        times.append(dt)
        max_rx.append(max(r[1] for r in rows))
        root_tx.append(rows[0][2])
        cpu.append(sum(r[3] for r in rows) / dt / ncpu * 100)
        ok = ok and all(r[4] for r in rows)
    if variant == "mpi-tuned" or extra_mca:
        tuned = TUNED_MCA[collective] if variant == "mpi-tuned" else {}
        note = " ".join(
            [
                *(
                    f"{k.removeprefix('coll_tuned_')}={v}"
                    for k, v in {**tuned, **dict(extra_mca)}.items()
                ),
                note,
            ]
        ).strip()
    if not ok:
        note = ("WRONG RESULT " + note).strip()
    return MpiRun(variant, collective, n, size, times, root_tx, max_rx, cpu, ok, note, argv)


def run_method(
    ec: Any, method: str, size: int, reps: int = 3, timeout: float | None = None
) -> MpiRun:
    variant, collective = parse_method(method)
    return run(ec, collective, size, reps, variant, timeout)


# ------------------------------------------------------------ rank program


def _nic_counters(dev: str = "eth0") -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``dev`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                v = rest.split()
                return int(v[0]), int(v[8])
    return 0, 0


def rank_main(collective: str, size: int, reps: int) -> int:
    import resource

    import mpi4py

    mpi4py.rc.threads = False
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    root = 0
    count = size // 8
    stride = max(1, count // 4096)
    total = n * (n + 1) / 2
    send = np.zeros(count)
    recv: Any = None
    if collective == "allreduce" or (collective == "reduce" and rank == root):
        recv = np.zeros(count)
    elif (collective == "gather" and rank == root) or collective == "allgather":
        recv = np.zeros(n * count)
    elif collective == "roundtrip":
        recv = np.zeros(count)

    def cpu_s() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def check(rep: int) -> bool:
        if collective in ("bcast", "roundtrip"):
            want = float(rep + 1)
            got = recv if collective == "roundtrip" else send
            if collective == "roundtrip" and rank != root:
                return True
            return bool((got[::stride] == want).all() and got[-1] == want)
        if collective == "reduce" and rank != root:
            return True
        if collective in ("reduce", "allreduce"):
            return bool((recv[::stride] == total).all() and recv[-1] == total)
        if rank != root and collective == "gather":
            return True
        blocks = recv.reshape(n, count)
        want_g = np.arange(1, n + 1, dtype=float)[:, None]
        return bool((blocks[:, ::stride] == want_g).all() and (blocks[:, -1:] == want_g).all())

    comm.Barrier()
    if rank == root:
        print(_READY, flush=True)
    records = []
    for rep in range(reps + 1):
        if collective in ("bcast", "roundtrip"):
            send.fill(float(rep + 1) if rank == root else 0.0)
        else:
            send.fill(float(rank + 1))
            if recv is not None:
                recv.fill(0.0)
        comm.Barrier()
        rx0, tx0 = _nic_counters()
        c0 = cpu_s()
        t0 = MPI.Wtime()
        if collective == "bcast":
            comm.Bcast(send, root=root)
        elif collective == "reduce":
            comm.Reduce(send, recv, op=MPI.SUM, root=root)
        elif collective == "allreduce":
            comm.Allreduce(send, recv, op=MPI.SUM)
        elif collective == "gather":
            comm.Gather(send, recv, root=root)
        elif collective == "allgather":
            comm.Allgather(send, recv)
        elif rank == root:  # roundtrip
            comm.Send(send, dest=1)
            comm.Recv(recv, source=1)
        elif rank == 1:
            comm.Recv(send, source=root)
            comm.Send(send, dest=root)
        t1 = MPI.Wtime()
        comm.Barrier()
        rx1, tx1 = _nic_counters()
        c1 = cpu_s()
        row = (t1 - t0, rx1 - rx0, tx1 - tx0, c1 - c0, check(rep))
        rows = comm.gather(row, root=root)
        if rank == root:
            records.append(rows)
    if rank == root:
        print(_MARK + json.dumps({"collective": collective, "n": n, "reps": records}), flush=True)
    return 0


# ------------------------------------------------------------ standalone


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rank-program", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--collective", choices=COLLECTIVES, help=argparse.SUPPRESS)
    p.add_argument("--size", default="64MiB")
    p.add_argument("--reps", type=int, default=3, help="warm reps after one cold rep")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=1000)
    p.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument(
        "--mca",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="extra MCA setting for every run (e.g. to try another forced algorithm)",
    )
    args = p.parse_args(argv)
    if args.rank_program:
        return rank_main(args.collective, int(args.size), args.reps)

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dask.utils import format_bytes, parse_bytes

    from benchmarks.emulation import EmulatedCluster

    ok, why = available()
    if not ok:
        print(f"MPI not available: {why}")
        return 1
    size = parse_bytes(args.size)
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        for collective in args.collectives:
            for variant in args.variants:
                t = time.perf_counter()
                r = run(ec, collective, size, args.reps, variant, extra_mca=args.mca)
                factor = {
                    "allreduce": 2 * (ec.n_workers - 1) / ec.n_workers,
                    "roundtrip": 2.0,
                }.get(collective, ec.n_workers - 1 if collective.endswith("gather") else 1.0)
                bound = factor * size / ec.rate_bytes_per_s
                print(
                    f"{variant:<10} {collective:<10} N={r.n} {format_bytes(size)} "
                    f"{r.seconds:.3f}s x bound {r.seconds / bound:.2f} "
                    f"reps {[round(x, 3) for x in r.all_seconds]} "
                    f"root tx {r.root_tx_bytes / size:.2f} S, max rx {r.max_rx_bytes / size:.2f} S, "
                    f"CPU {r.cpu:.0f}% ok={r.ok} ({time.perf_counter() - t:.0f}s wall) {r.note}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
