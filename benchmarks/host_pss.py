"""The memory each emulated host spends on an object: the sum of the PSS of
its worker processes (``/proc/PID/smaps_rollup``), sampled in a thread.

The emulated hosts share one kernel, so the machine's used memory cannot be
split by host; PSS counts a page shared by k processes 1/k in each, so the
sum over a host's workers is what that host holds, shared regions once
(issue 42: one copy per host).

The sum is read one process after another, so while workers map a region
(a page's PSS drops as its map count grows) a read can count a page once in
a worker read before the new mapping and again, shared, in one read after
it: a peak over such reads can exceed what the host held at any moment. So a
sample reads every worker of the host twice in a row and counts only if each
worker read the same within :data:`SETTLED` both times: no mapping changed
while it was read (a mapping of a region shared k ways moves each mapper's
PSS by S/k - S/(k+1), megabytes for the objects measured here). The peak of
every read, settled or not, is kept apart (``raw_peak``). The machine's
``Shmem`` (``/proc/meminfo``), where memfd regions are counted, is read in
one go; :class:`HostPeaks` samples its peak too.
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


#: Two reads of a worker's PSS within this many bytes of each other agree
#: (a worker receiving at 250 Mbit/s grows by about 30 KiB per millisecond).
SETTLED = 2**20


def pss_each(pids: list[int]) -> list[int]:
    """The PSS of each of ``pids`` in bytes (a process gone counts 0)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid).memory_full_info().pss)
        except psutil.Error:
            out.append(0)
    return out


def pss(pids: list[int]) -> int:
    """The sum of the PSS of ``pids`` in bytes (a process gone counts 0)."""
    return sum(pss_each(pids))


def settled_pss(pids: list[int]) -> tuple[int, int | None]:
    """The largest sum of two reads of ``pids``' PSS in a row, and the sum of
    the second if every worker read the same within :data:`SETTLED` both
    times (else None: a mapping changed while they were read)."""
    first, second = pss_each(pids), pss_each(pids)
    agree = all(abs(a - b) <= SETTLED for a, b in zip(first, second, strict=True))
    return max(sum(first), sum(second)), sum(second) if agree else None


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
        #: Per host, the peak of its settled samples (see the module's note).
        self.peak = dict(self.start_pss)
        #: Per host, the peak of every read, settled or not.
        self.raw_peak = dict(self.start_pss)
        #: Samples not counted: a mapping changed while they were read.
        self.unsettled = 0
        self.start_shmem = self.peak_shmem = shmem()
        self._done = threading.Event()
        self.start()

    def sample(self) -> None:
        for h, pids in self.hosts.items():
            raw, settled = settled_pss(pids)
            self.raw_peak[h] = max(self.raw_peak[h], raw)
            if settled is None:
                self.unsettled += 1
            else:
                self.peak[h] = max(self.peak[h], settled)
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
        """Per host, its settled peak over its PSS when sampling started."""
        return {h: self.peak[h] - self.start_pss[h] for h in self.hosts}

    def raw_growth(self) -> dict[str, int]:
        """Per host, the peak of every read over its PSS when sampling started."""
        return {h: self.raw_peak[h] - self.start_pss[h] for h in self.hosts}
