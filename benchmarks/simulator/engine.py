"""The event loop: simulated time, timed callbacks, and the network's own
events (flows starting, completing, catching up).

Between two events every rate is constant, so the loop jumps from event to
event: it asks the network for its next event, compares it with the earliest
timer, moves every flow forward to that time, runs the callbacks of the flows
that completed and of the timers that are due (arrivals, failures), and has the
network recompute its rates.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from benchmarks.simulator.network import INF, Network

#: Timers this close together run in one step.
TIME_EPS = 1e-12


class Engine:
    """Simulated time over one :class:`Network`."""

    def __init__(self, network: Network) -> None:
        self.net = network
        self.now = 0.0
        self.events = 0
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(now)`` at time ``t`` (at once if ``t`` has passed)."""
        heapq.heappush(self._timers, (max(t, self.now), next(self._seq), callback))

    def run(self, until: float = INF, max_events: int = 10_000_000) -> float:
        """Run until nothing is left to happen (or ``until``); returns the time."""
        while self.events < max_events:
            self.net.update_rates(self.now)
            t_net = self.net.next_event(self.now)
            t_timer = self._timers[0][0] if self._timers else INF
            t = min(t_net, t_timer)
            if t == INF or t > until:
                break
            self.net.advance(t - self.now)
            self.now = t
            self.events += 1
            for flow in self.net.finished():
                if flow.on_done is not None:
                    flow.on_done(flow, self.now)
            while self._timers and self._timers[0][0] <= self.now + TIME_EPS:
                _, _, callback = heapq.heappop(self._timers)
                callback(self.now)
        else:
            raise RuntimeError(f"simulation did not settle within {max_events} events")
        return self.now
