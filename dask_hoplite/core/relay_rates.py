"""The receive rates of a key's streams, and the relays that hold a chain back.

A pipelined chain moves at its slowest host's rate at every step: a relay whose
host is busy or whose NIC is throttled slows every receiver below it. Its rate
says so long before the stall timeout would: each receiver reports the byte
its stream reached every ``hoplite.broadcast.slow-relay.report-interval``, and
this class keeps the reports of the last ``window`` seconds per transfer.

A relay (a receiver that serves another) is *lagging* when, over the last
``window`` seconds:

* its receive rate is below ``ratio`` times its sender's own receive rate (the
  sender is a partial copy, still receiving), or below ``ratio`` times the
  measured per-host bandwidth when its sender holds a complete copy (no
  reference before the network model has measured one: nothing is judged);
* and, with a partial sender, that sender is at least ``min_lag`` bytes ahead
  of it: a relay whose sender is barely ahead is held back by the sender, not
  by itself.

A leaf is never judged: it holds nobody back. The directory decides what a
lagging relay costs (:meth:`~dask_hoplite.core.directory.ObjectDirectory.reroute`).

Plain data, no clock of its own: callers pass ``now``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from dataclasses import dataclass

#: Stream message, worker to scheduler: ``transfer_id`` reached ``position``.
PROGRESS_OP = "hoplite-progress"
#: Stream message, scheduler to worker: drop the stream of ``key`` from
#: ``sender`` (``transfer_id``) and ask the directory again without it.
REROUTE_OP = "hoplite-reroute"


@dataclass(frozen=True)
class Rate:
    """Bytes per second over the latest window, ending at byte ``position``."""

    bytes_per_s: float
    position: int


@dataclass(frozen=True)
class Lag:
    """A relay judged lagging: its ``rate`` and the ``reference`` it fell
    below a share of (its sender's rate, or the per-host bandwidth), in
    bytes per second."""

    rate: float
    reference: float


class RelayRates:
    """Progress reports per transfer, and the verdict on a relay.

    Parameters
    ----------
    window:
        Seconds of reports a rate is taken over; a transfer with fewer is not
        judged yet.
    ratio:
        A relay below this share of its reference rate is lagging.
    min_lag:
        Bytes a partial sender must be ahead of a relay for the relay to be
        the one holding the chain back.
    """

    def __init__(self, window: float, ratio: float, min_lag: int) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if not 0 < ratio < 1:
            raise ValueError(f"ratio must be in (0, 1), got {ratio}")
        if min_lag < 0:
            raise ValueError(f"min_lag must be >= 0, got {min_lag}")
        self.window = window
        self.ratio = ratio
        self.min_lag = min_lag
        self._reports: dict[int, deque[tuple[float, int]]] = {}
        #: The lowest share of its reference rate any relay was judged at
        #: (how near a chain without a fault came to a reroute).
        self.closest = float("inf")

    def observe(self, transfer_id: int, position: int, now: float) -> None:
        """The receiver of ``transfer_id`` had byte ``position`` at ``now``."""
        q = self._reports.setdefault(transfer_id, deque())
        if q and position < q[-1][1]:
            q.clear()  # a restart from an earlier byte: a new stream
        q.append((now, position))
        # Keep one report older than the window: the rate spans it whole.
        while len(q) > 2 and q[1][0] <= now - self.window:
            q.popleft()

    def rate(self, transfer_id: int) -> Rate | None:
        """The rate over the latest ``window`` seconds (None: too few reports)."""
        q = self._reports.get(transfer_id)
        if not q or len(q) < 2:
            return None
        (t0, p0), (t1, p1) = q[0], q[-1]
        if t1 - t0 < self.window:
            return None
        return Rate((p1 - p0) / (t1 - t0), p1)

    def lagging(
        self, transfer_id: int, sender_transfer_id: int | None, reference: float | None
    ) -> Lag | None:
        """The verdict on the relay receiving ``transfer_id`` (None: it does
        not hold its chain back): against the transfer into its sender
        (``sender_transfer_id``), or, for a sender with a complete copy
        (None), against ``reference`` bytes per second (None: no judgement)."""
        mine = self.rate(transfer_id)
        if mine is None:
            return None
        if sender_transfer_id is None:
            if reference is None or reference <= 0:
                return None
            return self._judge(mine.bytes_per_s, reference)
        theirs = self.rate(sender_transfer_id)
        if theirs is None or theirs.position - mine.position < self.min_lag:
            return None
        if theirs.bytes_per_s <= 0:
            return None
        return self._judge(mine.bytes_per_s, theirs.bytes_per_s)

    def _judge(self, mine: float, reference: float) -> Lag | None:
        share = mine / reference
        self.closest = min(self.closest, share)
        return Lag(mine, reference) if share < self.ratio else None

    def forget(self, transfer_id: int) -> None:
        self._reports.pop(transfer_id, None)

    def keep_only(self, transfer_ids: Container[int]) -> None:
        """Drop the reports of transfers that are over."""
        for tid in [t for t in self._reports if t not in transfer_ids]:
            del self._reports[tid]

    def __len__(self) -> int:
        return len(self._reports)
