"""The ``/hoplite`` page's inputs, read from the running scheduler part: the
workers' heartbeat reports, the directory's open transfers, the collective
log, the network estimate and the scheduler's counters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dask_hoplite.core.byte_ranges import describe
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.dashboard.state import page_state
from dask_hoplite.scheduler.collective_log import CollectiveLog
from dask_hoplite.scheduler.directory_service import DirectoryService
from dask_hoplite.worker.progress import METRIC

if TYPE_CHECKING:
    from distributed import Scheduler

#: A stream whose progress has not moved for this many seconds is drawn as
#: stalled (its receiver gives up on it only after ``hoplite.stall-timeout``).
STALL_SECONDS = 2.0


def live_state(
    s: Scheduler,
    service: DirectoryService,
    collectives: CollectiveLog,
    network: NetworkModel,
    stall_after: float = STALL_SECONDS,
) -> dict[str, Any]:
    """:func:`~dask_hoplite.dashboard.state.page_state` of the live scheduler."""
    reports = {
        addr: ws.metrics[METRIC]
        for addr, ws in s.workers.items()
        if isinstance(ws.metrics.get(METRIC), dict)
    }
    d = service.directory
    counters = {
        "directory-entries": len(d),
        "directory-transfers-active": len(d.transfers),
        "directory-requests-waiting": len(service.waiting),
        "directory-bytes-streamed": service.bytes_streamed,
        **{f"directory-answers-{k}": v for k, v in service.answers.items()},
        **{f"collectives-{k}-{o}": n for (k, o), n in collectives.counts.items()},
    }
    return page_state(
        workers=list(s.workers),
        reports=reports,
        transfers=[(describe(t.key), t.sender, t.receiver) for t in d.transfers.values()],
        collectives=list(collectives.recent)[::-1],  # newest first
        bandwidth=network.estimate().bandwidth,
        counters=counters,
        stall_after=stall_after,
    )
