"""The memory each emulated host spends on an object: the sum of the PSS of
its worker processes (``/proc/PID/smaps_rollup``), sampled in a thread.

The emulated hosts share one kernel, so the machine's used memory cannot be
split by host; PSS counts a page shared by k processes 1/k in each, so the
sum over a host's workers is what that host holds, shared regions once
(issue 42: one copy per host).

The sum is read one process after another, so while workers map a region
(a page's PSS drops as its map count grows) a sample can count a page once in
a worker read before the new mapping and again, shared, in one read after
it: a peak over samples can exceed what the host held at any moment. The
machine's ``Shmem`` (``/proc/meminfo``), where memfd regions are counted,
is read in one go; :class:`HostPeaks` samples its peak too.
"""

from __future__ import annotations

import threading

import psutil


def shmem() -> int:
    """The machine's shared memory (``Shmem`` of ``/proc/meminfo``), bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def pss(pids: list[int]) -> int:
    """The sum of the PSS of ``pids`` in bytes (a process gone counts 0)."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_full_info().pss
        except psutil.Error:
            pass
    return total


class HostPeaks(threading.Thread):
    """Per host, the peak of its workers' PSS sum, sampled every ``interval``
    seconds from construction until :meth:`stop`. ``hosts`` maps a host's
    name to its worker PIDs.

    A sample reads each worker's ``smaps_rollup``, which walks its page
    tables: about 1 ms per worker holding a few hundred MiB on the 2-core VM
    the benchmarks run on."""

    def __init__(self, hosts: dict[str, list[int]], interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.hosts = hosts
        self.interval = interval
        self.start_pss = {h: pss(p) for h, p in hosts.items()}
        self.peak = dict(self.start_pss)
        self.start_shmem = self.peak_shmem = shmem()
        self._done = threading.Event()
        self.start()

    def sample(self) -> None:
        for h, pids in self.hosts.items():
            self.peak[h] = max(self.peak[h], pss(pids))
        self.peak_shmem = max(self.peak_shmem, shmem())

    def run(self) -> None:
        while not self._done.is_set():
            self.sample()
            self._done.wait(self.interval)

    def stop(self) -> HostPeaks:
        self._done.set()
        self.join()
        self.sample()
        return self

    def shmem_growth(self) -> int:
        """The machine's ``Shmem`` peak over its value when sampling started."""
        return self.peak_shmem - self.start_shmem

    def growth(self) -> dict[str, int]:
        """Per host, its peak over its PSS when sampling started."""
        return {h: self.peak[h] - self.start_pss[h] for h in self.hosts}
