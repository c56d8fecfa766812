"""The progress of this worker's incoming streams, in its heartbeat.

Installed as ``worker.metrics["hoplite"]``: Dask calls it for every heartbeat
and the scheduler keeps the result in ``WorkerState.metrics["hoplite"]``,
where the ``/hoplite`` dashboard page reads the bytes so far of every edge of
the live broadcast chains and reduce trees. A stream whose progress has not
moved since an earlier heartbeat reports how long it has been stalled.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from dask_hoplite.worker.context import IncomingStream, WorkerContext

#: The name of the report in ``worker.metrics`` and the heartbeat.
METRIC = "hoplite"


class ProgressReport:
    """``worker.metrics["hoplite"]``: the incoming streams and their progress."""

    def __init__(self, ctx: WorkerContext, clock: Any = time.monotonic) -> None:
        self.ctx = ctx
        self.clock = clock
        #: The progress each stream had when it last moved, and when. Weak:
        #: a finished stream, and the buffer it filled, must not outlive the
        #: worker's own references until the next heartbeat. The buffer
        #: pool reuses a region only once nothing refers to its bytes, and a
        #: loop's next transfer, starting before that heartbeat, took fresh
        #: memory that the kernel zeroes while the socket fills it (at
        #: 1 Gbit/s on 2 cores such a repetition ran at up to 2.2x of S/B).
        self._moved: weakref.WeakKeyDictionary[IncomingStream, tuple[int, float]] = (
            weakref.WeakKeyDictionary()
        )

    def __call__(self, worker: Any = None) -> dict[str, Any]:
        now = self.clock()
        streams = []
        for s in list(self.ctx.incoming):
            progress = s.buf.progress
            before = self._moved.get(s)
            if before is None or before[0] != progress:
                self._moved[s] = (progress, now)
                stalled = 0.0
            else:
                stalled = now - before[1]
            streams.append(
                {
                    "key": str(s.key),
                    "sender": s.sender,
                    "kind": s.kind,
                    "progress": progress,
                    "nbytes": s.buf.nbytes,
                    "stalled": stalled,
                    "resumed_from": s.start,
                }
            )
        return {"streams": streams, "stats": dict(self.ctx.stats)}
