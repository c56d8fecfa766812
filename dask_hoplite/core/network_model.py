"""The cluster's per-host bandwidth B and per-hop latency L, as measured.

Reduce trees are shaped by Hoplite's rule ``k = S / (B * L)``
(:func:`dask_hoplite.core.tree_shape.max_chain_length`). The scheduler part keeps one
:class:`NetworkModel`: every worker reports each hoplite stream it received
(bytes, seconds from the sender's assignment to the last byte) and its own
latency to the scheduler as Dask measures it on heartbeats. The estimates are
medians of the latest samples, so one slow or one cached transfer does not
swing the tree shape. A value set in ``hoplite.reduce.bandwidth`` /
``hoplite.reduce.latency`` overrides the measurement; before the first sample
the built-in fallbacks below are used.

Sans-IO: fed with observations, asked for estimates; no clock, no sockets.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

#: Before any measurement: a 1 Gbit/s NIC and the reference implementation's
#: 750 us per hop (which makes objects above ~100 kB chains).
FALLBACK_BANDWIDTH = 125e6
FALLBACK_LATENCY = 750e-6
#: Transfers shorter than this say more about latency than bandwidth.
MIN_SAMPLE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class NetworkEstimate:
    bandwidth: float  # bytes per second per host
    latency: float  # seconds per hop
    measured: bool  # False: fallbacks or configured values only

    def to_msg(self) -> dict[str, float | bool]:
        return {"bandwidth": self.bandwidth, "latency": self.latency, "measured": self.measured}

    @classmethod
    def from_msg(cls, m: dict[str, Any]) -> NetworkEstimate:
        return cls(float(m["bandwidth"]), float(m["latency"]), bool(m["measured"]))


class NetworkModel:
    """Running medians of per-stream throughput and per-worker latency.

    Parameters
    ----------
    bandwidth, latency:
        Fixed values (from configuration) that override the measurements;
        ``None`` to use the measurements.
    window:
        How many of the latest samples each median is taken over.
    """

    def __init__(
        self, bandwidth: float | None = None, latency: float | None = None, window: int = 64
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.fixed_bandwidth = bandwidth
        self.fixed_latency = latency
        self._throughputs: deque[float] = deque(maxlen=window)
        self._latencies: deque[float] = deque(maxlen=window)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """A stream of ``nbytes`` took ``seconds`` (assignment to last byte)."""
        if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
            self._throughputs.append(nbytes / seconds)

    def observe_latency(self, seconds: float) -> None:
        """One worker's latency to the scheduler, as Dask measured it."""
        if seconds > 0:
            self._latencies.append(seconds)

    def estimate(self) -> NetworkEstimate:
        bw, lat, measured = self.fixed_bandwidth, self.fixed_latency, False
        if bw is None:
            if self._throughputs:
                bw, measured = statistics.median(self._throughputs), True
            else:
                bw = FALLBACK_BANDWIDTH
        if lat is None:
            if self._latencies:
                lat, measured = statistics.median(self._latencies), True
            else:
                lat = FALLBACK_LATENCY
        return NetworkEstimate(bw, lat, measured)
