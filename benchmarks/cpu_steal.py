"""CPU time the VM's hypervisor gave to others while a benchmark ran (steal),
read from ``/proc/stat``: on a virtual machine whose host is busy, every
figure of a run is slower than the machine itself would make it, so the
benchmarks print the share beside their times (``applications.py`` per
application, ``loop.py`` per repetition)."""

from __future__ import annotations


def cpu_times() -> list[int]:
    """This machine's CPU time counters (``/proc/stat``, all CPUs): user,
    nice, system, idle, iowait, irq, softirq, steal, in clock ticks."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of CPU time the hypervisor took away (steal) between two
    :func:`cpu_times`."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return delta[7] / max(1, sum(delta))
