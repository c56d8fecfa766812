"""What the peers benchmark's modules share: the measured record, the physical
bound of every operation, and the memory check for the largest runs.

Bounds, in units of S/B (S = bytes of one object, B = one NIC's rate, full
duplex, N hosts):

* ``broadcast``  1: every receiver's NIC must take in S bytes;
* ``reduce``     1: every contributor's NIC must send out S bytes;
* ``allreduce``  2(N-1)/N: the standard bound (a reduce-scatter, then an
  allgather, of S/N blocks: every NIC sends and receives 2(N-1)/N * S);
* ``gather``     N-1: the root's NIC must take in the N-1 other objects;
* ``allgather``  N-1: every host's NIC must take in the N-1 other objects;
* ``roundtrip``  2: one object from host A to host B, complete there, and back
  from B to A (store and forward: B has the whole object before it sends).
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

COLLECTIVES = ("broadcast", "reduce", "allreduce", "gather", "allgather")
OPERATIONS = (*COLLECTIVES, "roundtrip")
SYSTEMS = ("dask", "hoplite", "mpi-tuned", "ray", "gloo")

_MARK = "HPLPEER "


def bound_factor(op: str, n: int) -> float:
    """The physical bound of ``op`` on ``n`` hosts, in units of S/B."""
    if op in ("broadcast", "reduce"):
        return 1.0
    if op == "allreduce":
        return 2 * (n - 1) / n
    if op in ("gather", "allgather"):
        return float(n - 1)
    if op == "roundtrip":
        return 2.0
    raise ValueError(f"unknown operation {op!r}")


def bound_seconds(op: str, n: int, size: int, rate_bytes_per_s: float) -> float:
    return bound_factor(op, n) * size / rate_bytes_per_s


def resident_bytes(op: str, n: int, size: int) -> int:
    """Bytes the cluster holds at the peak of ``op`` (inputs and outputs)."""
    if op == "allgather":
        return (n * n + n) * size
    if op == "gather":
        return 2 * n * size
    return 2 * n * size


@dataclass
class Measured:
    """One system's times for one operation at one size (rep 0 cold)."""

    system: str
    op: str
    size: int
    n: int
    all_seconds: list[float] = field(default_factory=list)
    ok: bool = True
    note: str = ""
    available: bool = True  # False: the system could not run at all (note says why)

    @property
    def seconds(self) -> float:
        warm = self.all_seconds[1:] or self.all_seconds
        return statistics.median(warm) if warm else float("inf")


def mark(payload: str) -> str:
    """A result line that a launcher picks out of a child's stdout."""
    return _MARK + payload


def unmark(text: str) -> list[str]:
    """The payloads of the result lines in ``text``."""
    return [ln[len(_MARK) :] for ln in text.splitlines() if ln.startswith(_MARK)]


MIN_FREE_BYTES = 1 << 30


def wait_watched(
    procs: Sequence[subprocess.Popen], timeout: float, min_free: int = MIN_FREE_BYTES
) -> str:
    """Wait for ``procs`` (each its own process group); "" when they all ended,
    else why they were killed: the timeout, or this machine's free memory
    falling under ``min_free`` (a peer's largest allgather can hold N*N
    objects, and the machine is shared)."""
    import psutil

    deadline = time.monotonic() + timeout
    why = ""
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            why = f"did not finish in {timeout:.0f}s"
        elif psutil.virtual_memory().available < min_free:
            why = f"stopped: free memory fell below {min_free / 2**30:.0f} GiB"
        else:
            time.sleep(0.25)
            continue
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
        break
    return why
