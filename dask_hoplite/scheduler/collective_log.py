"""What the collectives did: each reduce tree's root reports its end
(``hoplite-collective``); this log keeps the counts by kind and outcome and
the latest ones, for ``/metrics`` and the ``/hoplite`` page."""

from __future__ import annotations

from collections import Counter, deque
from time import time
from typing import Any

#: How many finished collectives the log keeps.
RECENT = 50


class CollectiveLog:
    """Counts and the latest reports of the collectives that finished."""

    def __init__(self) -> None:
        #: (kind, outcome) -> how many.
        self.counts: Counter[tuple[str, str]] = Counter()
        #: The latest reports, oldest first: kind, outcome, rid, root, inputs,
        #: nbytes, seconds, and the time the scheduler got the report.
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT)

    def finished(
        self,
        kind: str,
        outcome: str,
        worker: str | None = None,
        **report: Any,
    ) -> None:
        """Stream ``hoplite-collective``: a collective rooted on ``worker`` ended."""
        self.counts[str(kind), str(outcome)] += 1
        self.recent.append({"kind": kind, "outcome": outcome, "time": time(), **report})
