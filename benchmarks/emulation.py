"""An emulated cluster on one Linux machine: one network namespace per host.

Each host gets a veth pair whose far end sits in a bridge that lives in a
namespace of its own (the "switch"); ``tc tbf`` caps both directions of every
host NIC (egress on the host's own veth; egress on the switch port, which is the
host's ingress), so each host behaves like a full-duplex NIC of rate B. The
scheduler, the workers and the measuring client run inside the namespaces via
``ip netns exec``.

While it runs, the VM keeps the memory its processes free, as a real host
does (:mod:`benchmarks.vm_memory`: the benchmarks' VM otherwise hands freed
memory back to its hypervisor, and touching it again is then 20-30 times
slower than on a host).

Only addresses inside the namespaces made here are used (a private /24 that
exists nowhere else), every process started is killed and every namespace
deleted on exit, on Ctrl-C and on failure (``with EmulatedCluster(...)``, plus
an ``atexit`` and SIGTERM/SIGINT guard). Needs root and iproute2.

    with EmulatedCluster(n_workers=8, rate_mbit=1000) as ec:
        ec.start_dask()
        out = ec.run_in_client([sys.executable, "-c", "..."])
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.vm_memory import KeptFreedMemory
from dask_hoplite.compat import worker_addresses

logger = logging.getLogger(__name__)


def available() -> tuple[bool, str]:
    """Whether this process can build an emulated cluster, and why not."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "building network namespaces needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) is not installed"
    probe = f"hplprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return False, f"'ip netns add' failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclass
class Host:
    name: str  # role: "sched" or "w0".."wN-1"
    netns: str
    address: str  # IPv4 address of its NIC
    procs: list[subprocess.Popen] = field(default_factory=list)
    port: str = ""  # its NIC's other end, on the switch


_LIVE: list[EmulatedCluster] = []


def _teardown_all(*_: object) -> None:
    for ec in list(_LIVE):
        ec.close()


def _on_signal(signum: int, frame: object) -> None:
    _teardown_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


class EmulatedCluster:
    """N worker hosts and one scheduler/client host on rate-limited NICs.

    Parameters
    ----------
    n_workers:
        Worker hosts (one Dask worker process each).
    rate_mbit:
        Per-host NIC rate, both directions, in Mbit/s.
    mtu:
        MTU of every link (1500 like most clusters; 9000 for jumbo frames).
    subnet:
        First three octets of the private /24 used inside the namespaces.
    workers_per_host:
        Dask worker processes on each worker host (they share its NIC).
    """

    def __init__(
        self,
        n_workers: int,
        rate_mbit: float = 1000,
        mtu: int = 1500,
        subnet: str = "10.213.77",
        workers_per_host: int = 1,
    ) -> None:
        if not 1 <= n_workers <= 200:
            raise ValueError(f"n_workers must be in [1, 200], got {n_workers}")
        if not 1 <= workers_per_host <= 16:
            raise ValueError(f"workers_per_host must be in [1, 16], got {workers_per_host}")
        ok, why = available()
        if not ok:
            raise RuntimeError(f"cannot build an emulated cluster: {why}")
        self.n_workers = n_workers  # worker hosts
        self.workers_per_host = workers_per_host
        self.rate_mbit = rate_mbit
        self.mtu = mtu
        self.subnet = subnet
        self.prefix = f"hpl{os.getpid() % 100000}"
        self.switch = f"{self.prefix}-sw"
        self.hosts: dict[str, Host] = {}
        self.scheduler_address: str | None = None
        self._closed = False
        self._created: list[str] = []
        #: The VM's freed memory kept while the cluster runs (``.active``,
        #: or ``.why`` not).
        self.memory = KeptFreedMemory()

    # ---------------------------------------------------------------- build

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8

    def __enter__(self) -> EmulatedCluster:
        _LIVE.append(self)
        if len(_LIVE) == 1:
            atexit.register(_teardown_all)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, _on_signal)
        try:
            self.memory.start()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tbf(self, netns: str, dev: str, rate_mbit: float | None = None) -> None:
        rate_bps = (self.rate_mbit if rate_mbit is None else rate_mbit) * 1e6
        burst = int(max(0.002 * rate_bps / 8, 96 * 1024))  # room for GSO super-packets
        _run(
            "ip",
            "netns",
            "exec",
            netns,
            "tc",
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{int(rate_bps)}bit",
            "burst",
            str(burst),
            "latency",
            "20ms",
        )

    def _build(self) -> None:
        _run("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(*sw, "link", "add", "br0", "type", "bridge")
        _run(*sw, "link", "set", "br0", "mtu", str(self.mtu), "up")
        _run(*sw, "link", "set", "lo", "up")
        roles = ["sched"] + [f"w{i}" for i in range(self.n_workers)]
        for i, role in enumerate(roles):
            ns = f"{self.prefix}-{role}"
            addr = f"{self.subnet}.{i + 1}"
            _run("ip", "netns", "add", ns)
            self._created.append(ns)
            port = f"p{i}"
            # Create the pair in the host namespace, then move the switch end.
            _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port)
            _run("ip", "-n", ns, "link", "set", port, "netns", self.switch)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "mtu", str(self.mtu))
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run(*sw, "link", "set", port, "mtu", str(self.mtu))
            _run(*sw, "link", "set", port, "master", "br0")
            _run(*sw, "link", "set", port, "up")
            self._tbf(ns, "eth0")
            self._tbf(self.switch, port)
            self.hosts[role] = Host(role, ns, addr, port=port)

    def set_rate(self, role: str, rate_mbit: float | None = None) -> None:
        """Host ``role``'s NIC at ``rate_mbit`` both ways (None: the
        cluster's rate again), as a host whose link degrades mid-run."""
        h = self.hosts[role]
        self._tbf(h.netns, "eth0", rate_mbit)
        self._tbf(self.switch, h.port, rate_mbit)

    # ---------------------------------------------------------- processes

    def exec_prefix(self, role: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[role].netns]

    def spawn(
        self,
        role: str,
        argv: Sequence[str],
        env: dict[str, str] | None = None,
        log: str | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` inside host ``role``'s namespace (own process group)."""
        out = open(log, "ab") if log else subprocess.DEVNULL
        p = subprocess.Popen(
            [*self.exec_prefix(role), *argv],
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
            start_new_session=True,
        )
        self.hosts[role].procs.append(p)
        return p

    def start_dask(
        self,
        env: dict[str, str] | None = None,
        preload: str | None = None,
        nthreads: int = 1,
        log_dir: str | None = None,
        timeout: float = 60,
    ) -> str:
        """Scheduler on the ``sched`` host, ``workers_per_host`` worker
        processes on each worker host."""
        sched = self.hosts["sched"]
        self.scheduler_address = f"tcp://{sched.address}:8786"
        argv = [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            sched.address,
            "--port",
            "8786",
            "--dashboard-address",
            ":0",
        ]
        if preload:
            argv += ["--preload", preload]
        self.spawn("sched", argv, env, os.path.join(log_dir, "scheduler.log") if log_dir else None)
        for i in range(self.n_workers):
            self.start_workers(f"w{i}", env, nthreads, log_dir)
        code = (
            "import sys, time\n"
            "from distributed import Client\n"
            f"c = Client({self.scheduler_address!r}, timeout={timeout})\n"
            f"c.wait_for_workers({self.n_workers * self.workers_per_host}, timeout={timeout})\n"
            "c.close()\n"
        )
        self.run_in_client([sys.executable, "-c", code], timeout=timeout + 30)
        return self.scheduler_address

    def start_workers(
        self,
        role: str,
        env: dict[str, str] | None = None,
        nthreads: int = 1,
        log_dir: str | None = None,
    ) -> None:
        """Start host ``role``'s worker processes (again, after a kill: the
        dead ones are forgotten), named ``role`` (``role-j`` with several per
        host); they join the scheduler started by :meth:`start_dask`."""
        host = self.hosts[role]
        host.procs = [p for p in host.procs if p.poll() is None]
        for j in range(self.workers_per_host):
            name = role if self.workers_per_host == 1 else f"{role}-{j}"
            self.spawn(
                role,
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    self.scheduler_address,
                    "--host",
                    host.address,
                    "--nthreads",
                    str(nthreads),
                    "--no-nanny",
                    "--name",
                    name,
                    "--dashboard-address",
                    ":0",
                    "--memory-limit",
                    "0",
                ],
                env,
                os.path.join(log_dir, f"{name}.log") if log_dir else None,
            )

    def run_in_client(
        self, argv: Sequence[str], timeout: float = 600, env: dict[str, str] | None = None
    ) -> str:
        """Run ``argv`` on the scheduler host and return its stdout."""
        r = subprocess.run(
            [*self.exec_prefix("sched"), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
        if r.returncode != 0:
            raise RuntimeError(f"client process failed ({r.returncode}):\n{r.stderr[-4000:]}")
        return r.stdout

    def stop_dask(self) -> None:
        for h in self.hosts.values():
            self._kill(h)

    def worker_addresses(self, client: Any) -> list[str]:
        """The Dask worker addresses in host order: with one worker per host,
        element i runs on host ``w{i}``; with k per host, elements
        ``i*k .. i*k+k-1`` do."""
        role_of = {h.address: role for role, h in self.hosts.items()}
        by_role: dict[str, list[str]] = {}
        for a in sorted(worker_addresses(client)):
            by_role.setdefault(role_of[a.split("://")[-1].rsplit(":", 1)[0]], []).append(a)
        return [a for i in range(self.n_workers) for a in by_role[f"w{i}"]]

    def pids(self) -> list[int]:
        """PIDs of the Dask processes (children of ``ip netns exec``)."""
        return [p.pid for h in self.hosts.values() for p in h.procs if p.poll() is None]

    def signal(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to every process of host ``role`` (failure injection:
        SIGKILL a host, SIGSTOP / SIGCONT to hang and resume it)."""
        for p in self.hosts[role].procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        if sig == signal.SIGKILL:
            for p in self.hosts[role].procs:
                with contextlib.suppress(Exception):
                    p.wait(timeout=10)

    def enter_namespace(self, role: str = "sched") -> None:
        """Move this (still single-threaded) process into host ``role``'s
        network namespace, so that a Dask client created afterwards talks to
        the cluster over the emulated network. Teardown still works from there:
        ``ip netns del`` does not depend on the caller's namespace."""
        import ctypes
        import threading

        if threading.active_count() > 1:
            raise RuntimeError("enter_namespace must run before any thread starts")
        libc = ctypes.CDLL(None, use_errno=True)
        clone_newnet = 0x40000000
        with open(f"/var/run/netns/{self.hosts[role].netns}") as f:
            if libc.setns(f.fileno(), clone_newnet) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {role}: {os.strerror(err)}")

    # ------------------------------------------------------------ counters

    def nic_bytes(self, role: str) -> tuple[int, int]:
        """(tx_bytes, rx_bytes) of a host's NIC."""
        r = _run("ip", "-n", self.hosts[role].netns, "-s", "-j", "link", "show", "eth0")
        stats = json.loads(r.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def tcp_counters(self, role: str) -> dict[str, int]:
        """A host's TCP counters (``/proc/net/snmp`` and ``/proc/net/netstat``
        in its namespace: ``RetransSegs``, ``TCPTimeouts``, ``TCPLossProbes``...)."""
        ns = self.hosts[role].netns
        out: dict[str, int] = {}
        for path in ("/proc/net/snmp", "/proc/net/netstat"):
            lines = _run("ip", "netns", "exec", ns, "cat", path).stdout.splitlines()
            for names, values in zip(lines[::2], lines[1::2], strict=False):
                kind, _, names = names.partition(":")
                if kind in ("Tcp", "TcpExt"):
                    counts = map(int, values.partition(":")[2].split())
                    out.update(zip(names.split(), counts, strict=True))
        return out

    # ------------------------------------------------------------ teardown

    @staticmethod
    def _kill(h: Host) -> None:
        for p in h.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in h.procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=10)
        h.procs.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            self._kill(h)
        for ns in reversed(self._created):
            # Kill anything still inside the namespace, then delete it (its
            # veth ends go with it).
            r = _run("ip", "netns", "pids", ns, check=False)
            for pid in r.stdout.split():
                if pid.isdigit() and int(pid) != os.getpid():  # we may live in it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            _run("ip", "netns", "del", ns, check=False)
        self._created.clear()
        self.memory.stop()
        if self in _LIVE:
            _LIVE.remove(self)
