"""A worker's memory as Dask should see it when it maps pages shared with the
other workers of its host (issue 42: one copy per host).

Dask's worker memory manager reads the process's RSS
(``SystemMonitor.get_process_memory``) to decide when to spill and when to
pause. RSS counts a page in every process that maps it, and once in each of a
process's own mappings: four workers mapping one 1 GiB region look like 4 GiB
(5 GiB with the receiver's writable mapping), and each of them would spill
and pause as if it held the object alone. :func:`process_memory` counts the
shared-memory pages (memfd regions are shared memory: ``RssShmem``) at their
proportional share instead (``Pss_Shmem``): a page mapped by k processes
counts 1/k in each, so the workers of a host add up to what the host holds.

Its cost is a walk of the process's page tables (``smaps_rollup``), about
1 ms per GiB mapped on the 2-core VM the benchmarks run on, paid only while
the process maps shared memory (``RssShmem`` is read first, from
``/proc/PID/status``); the worker plugin puts it in place of Dask's reading
only where host sharing is on.

The nanny, which reads its worker's RSS itself to terminate it at
``distributed.worker.memory.terminate`` (95% of the limit by default), reads
it through :mod:`dask_hoplite.worker.nanny_memory`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _kib_fields(path: str, names: tuple[str, ...]) -> dict[str, int]:
    """``name: value`` lines of a ``/proc`` file, in bytes (values in kB)."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in names:
                out[name] = int(rest.split()[0]) * 1024
    return out


def process_memory(pid: int | str = "self") -> int | None:
    """The RSS of process ``pid`` with its shared-memory pages counted at
    their proportional share, in bytes; None where ``/proc`` does not say
    (not Linux, or a kernel without ``Pss_Shmem``)."""
    try:
        status = _kib_fields(f"/proc/{pid}/status", ("VmRSS", "RssShmem"))
        if len(status) != 2:
            return None
        if not status["RssShmem"]:  # nothing shared mapped: no page walk
            return status["VmRSS"]
        rollup = _kib_fields(f"/proc/{pid}/smaps_rollup", ("Pss_Shmem",))
    except (OSError, ValueError):
        return None
    if not rollup:
        return None
    return status["VmRSS"] - status["RssShmem"] + rollup["Pss_Shmem"]


def shared_aware(rss: Callable[[], int]) -> Callable[[], int]:
    """A replacement for Dask's ``get_process_memory``: :func:`process_memory`
    of this process, or ``rss()`` where it cannot be read."""

    def get_process_memory() -> int:
        memory = process_memory()
        return rss() if memory is None else memory

    return get_process_memory
