"""Flow-level network: hosts with full-duplex NICs, max-min fair sharing, and
pipelined flows that cannot overtake the bytes their sender has.

A :class:`Buffer` is one object landing on one worker, in order: its first
``pos`` bytes are valid. A :class:`Flow` writes into one buffer from a sending
host to a receiving host and forwards bytes that one or more *source* buffers
already hold: a relay of a broadcast chain forwards its own partially filled
buffer; a reduce node forwards the sum of its children's streams, so its
outgoing flow reads all of their buffers. A flow stays ``lag`` bytes behind
every source that is not complete yet (a relay forwards a block once all of it
has landed, and each hop adds latency), so a receiver is never ahead of its
sender.

Rates are max-min fair over every host's uplink and downlink (progressive
filling). A flow that has caught up with a source can go no faster than the
flow filling that source: progressive filling freezes such a *follower* the
moment its leader is frozen. Rates are constant between events, so the time of
the next event (a flow starts, completes, catches up with a source, or is
unblocked by one) is computed exactly; nothing is simulated block by block.

Rates are recomputed incrementally: only for the flows an event touched, the
flows sharing a link with them, and, while rates change, the flows reading
their buffers. That set is closed under link sharing, so progressive filling
over it (the rates of leaders outside it held fixed) gives the same rates as
over every flow (``incremental=False`` recomputes everything, for checking).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: Positions within this many bytes count as equal (rounding of rate * time).
EPS = 1.0
INF = math.inf


@dataclass(eq=False, slots=True)
class Buffer:
    """One object's bytes arriving on one worker, in order."""

    size: float
    pos: float = 0.0
    #: The flow writing into this buffer now (None: nothing arrives).
    inflow: Flow | None = None

    @property
    def complete(self) -> bool:
        return self.pos >= self.size - EPS


@dataclass(eq=False, slots=True)
class Flow:
    """A stream from host ``src`` into ``into`` on host ``dst``."""

    src: str
    dst: str
    into: Buffer
    #: Buffers whose bytes this flow forwards (empty: a complete local copy).
    sources: tuple[Buffer, ...] = ()
    #: Bytes a source must hold beyond what this flow has sent.
    lag: float = 0.0
    #: When the first byte may leave (a decision plus its setup latency).
    start: float = 0.0
    #: Called with the flow and the time when the buffer is complete.
    on_done: Callable[[Flow, float], None] | None = None
    rate: float = 0.0
    #: Bytes this flow carried (a resumed buffer's earlier bytes excluded).
    carried: float = 0.0
    #: Sources that bound it now (filled in by the rate computation).
    leaders: list[Buffer] = field(default_factory=list)
    #: The links it uses: the sender's uplink and the receiver's downlink, or
    #: the host's memory for a stream between two workers of one host.
    keys: tuple[tuple[str, str], ...] = field(init=False)
    #: The capacity of each of those links (set when added to a network).
    caps: tuple[float, ...] = field(init=False, default=())
    #: Absolute time of its next event (start, completion, catch-up, unblocking).
    event: float = field(init=False, default=INF)

    def __post_init__(self) -> None:
        if self.src == self.dst:
            self.keys = (("m", self.src),)
        else:
            self.keys = (("u", self.src), ("d", self.dst))


class Network:
    """Hosts with per-direction capacities (bytes/s) and the flows on them."""

    #: Recompute rates only where an event changed something (False: every
    #: flow at every event, the reference the incremental way is checked against).
    incremental_default = True

    def __init__(
        self,
        default_capacity: float,
        local_capacity: float = 1e12,
        incremental: bool | None = None,
    ) -> None:
        self.default_capacity = default_capacity
        #: Rate of a stream between two workers of one host (memory, not NIC).
        self.local_capacity = local_capacity
        self.incremental = self.incremental_default if incremental is None else incremental
        self.up: dict[str, float] = {}
        self.down: dict[str, float] = {}
        self.flows: dict[Flow, None] = {}  # insertion-ordered set: deterministic
        self._on_link: dict[tuple[str, str], dict[Flow, None]] = {}
        self._readers: dict[Buffer, dict[Flow, None]] = {}
        self._dirty: dict[Flow, None] = {}
        self._events: list[tuple[float, int, Flow]] = []
        self._seq = itertools.count()

    def set_capacity(self, host: str, up: float, down: float) -> None:
        self.up[host], self.down[host] = up, down

    def add(self, flow: Flow) -> Flow:
        flow.caps = tuple(self._capacity(k) for k in flow.keys)
        flow.into.inflow = flow
        self.flows[flow] = None
        for k in flow.keys:
            self._on_link.setdefault(k, {})[flow] = None
        for b in flow.sources:
            self._readers.setdefault(b, {})[flow] = None
        self._touch(flow)
        self._touch_readers(flow.into)
        return flow

    def remove(self, flow: Flow) -> None:
        if flow not in self.flows:
            return
        del self.flows[flow]
        flow.rate = 0.0
        self._dirty.pop(flow, None)
        for k in flow.keys:
            self._on_link[k].pop(flow, None)
            for g in self._on_link[k]:
                self._touch(g)
        for b in flow.sources:
            self._readers[b].pop(flow, None)
        if flow.into.inflow is flow:
            flow.into.inflow = None
        self._touch_readers(flow.into)

    def flows_into(self, host: str) -> int:
        """How many flows share ``host``'s downlink now."""
        return len(self._on_link.get(("d", host), ()))

    def remove_host(self, host: str) -> list[Flow]:
        """Drop every flow from or to ``host`` (it died); returns them."""
        gone = [f for f in self.flows if host in (f.src, f.dst)]
        for f in gone:
            self.remove(f)
        return gone

    def _touch(self, flow: Flow) -> None:
        self._dirty[flow] = None

    def _touch_readers(self, buffer: Buffer) -> None:
        for g in self._readers.get(buffer, ()):
            self._dirty[g] = None

    # ----------------------------------------------------------------- time

    def advance(self, dt: float) -> None:
        if dt <= 0:
            return
        for f in self.flows:
            if f.rate > 0:
                step = min(f.rate * dt, f.into.size - f.into.pos)
                f.into.pos += step
                f.carried += step

    def finished(self) -> list[Flow]:
        """Flows whose buffer is complete; removed from the network."""
        done = [f for f in self.flows if f.into.pos >= f.into.size - EPS]
        for f in done:
            f.into.pos = f.into.size
            self.remove(f)
        return done

    def next_event(self, now: float) -> float:
        """Absolute time of the next start, completion, catch-up or unblocking."""
        ev = self._events
        while ev and (ev[0][2] not in self.flows or ev[0][2].event != ev[0][0]):
            heapq.heappop(ev)
        return ev[0][0] if ev else INF

    def _schedule(self, f: Flow, now: float) -> None:
        if f.start > now:
            dt = f.start - now
        elif f.rate > 0:
            dt = min((f.into.size - f.into.pos) / f.rate, self._catch_up(f))
        else:
            dt = self._unblock(f)
        f.event = now + dt
        if f.event < INF:
            heapq.heappush(self._events, (f.event, next(self._seq), f))

    @staticmethod
    def _catch_up(f: Flow) -> float:
        """Seconds until ``f`` reaches a source it is not following yet."""
        t = INF
        for b in f.sources:
            if b.pos >= b.size - EPS or b in f.leaders:
                continue
            closing = f.rate - (b.inflow.rate if b.inflow is not None else 0.0)
            if closing > 0:
                t = min(t, max(0.0, b.pos - f.lag - f.into.pos) / closing)
        return t

    @staticmethod
    def _unblock(f: Flow) -> float:
        """Seconds until every source of a stopped flow is ahead of it again:
        more than ``EPS`` bytes ahead, as the rate computation counts it. A
        source within ``EPS`` of it counts too (a stalled one holds the flow
        until its own rate changes, which reschedules its readers): measured
        from exactly 0 bytes short, the wait can be shorter than the clock's
        resolution, and the loop would step in place for ever."""
        t = 0.0
        for b in f.sources:
            short = f.into.pos + f.lag - b.pos
            if short > -EPS and b.pos < b.size - EPS:
                r = b.inflow.rate if b.inflow is not None else 0.0
                if r <= 0:
                    return INF
                t = max(t, (short + EPS) / r)
        return t if t > 0 else INF

    # ---------------------------------------------------------------- rates

    def update_rates(self, now: float) -> None:
        """Max-min fair rates by progressive filling, followers capped by leaders,
        recomputed where something changed since the last call."""
        ev = self._events
        while ev and ev[0][0] <= now * (1 + 1e-12) + 1e-12:
            _, _, f = heapq.heappop(ev)
            if f in self.flows and f.event <= now * (1 + 1e-12) + 1e-12:
                self._dirty[f] = None
        pending = list(self.flows) if not self.incremental else list(self._dirty)
        self._dirty.clear()
        reschedule: dict[Flow, None] = {}
        rounds = 0
        while pending:
            rounds += 1
            if rounds > 2 * len(self.flows) + 10:  # never seen; a full pass is exact
                pending = list(self.flows)
            group = self._link_closure(pending)
            old = {f: f.rate for f in group}
            self._fill(group, now)
            reschedule.update(group)
            pending = []
            for f in group:
                if f.rate != old[f]:
                    for g in self._readers.get(f.into, ()):
                        reschedule[g] = None
                        if g not in group:
                            pending.append(g)
        for f in reschedule:
            if f in self.flows:
                self._schedule(f, now)

    def _link_closure(self, flows: Iterable[Flow]) -> dict[Flow, None]:
        """``flows`` and every flow that shares a link with one of them, transitively."""
        group: dict[Flow, None] = {}
        stack = [f for f in flows if f in self.flows]
        while stack:
            f = stack.pop()
            if f in group:
                continue
            group[f] = None
            for k in f.keys:
                stack.extend(g for g in self._on_link[k] if g not in group)
        return group

    def _fill(self, group: dict[Flow, None], now: float) -> None:
        """Progressive filling over ``group`` (closed under link sharing); a
        leader outside it caps its followers at its current rate."""
        unfrozen: dict[Flow, None] = {}
        followers: dict[Flow, list[Flow]] = {}
        limit: dict[Flow, float] = {}  # caps from leaders outside the group
        for f in group:
            f.rate = 0.0
            if f.start > now:
                continue
            pos, leaders, waits, cap = f.into.pos, [], False, INF
            for b in f.sources:
                ahead = b.pos - f.lag - pos
                if ahead > EPS or b.pos >= b.size - EPS:
                    continue  # it may run ahead of this source for now
                if ahead < -EPS or b.inflow is None:
                    waits = True  # a source is behind it, or stalled: rate 0
                elif b.inflow not in group:
                    cap = min(cap, b.inflow.rate)
                leaders.append(b)
            f.leaders = leaders
            if waits or cap <= 0:
                continue
            unfrozen[f] = None
            if cap < INF:
                limit[f] = cap
            for b in leaders:
                if b.inflow in group:
                    followers.setdefault(b.inflow, []).append(f)
        residual, load = self._links(unfrozen)
        # Leaders that are not running (not started, stopped) hold followers at 0.
        for leader in list(followers):
            if leader not in unfrozen:
                self._freeze([leader], 0.0, unfrozen, followers, residual, load)
        while unfrozen:
            level = min(
                min((residual[k] / n for k, n in load.items() if n > 0), default=INF),
                min((limit[f] for f in limit if f in unfrozen), default=INF),
            )
            level = max(level, 0.0)
            top = level * (1 + 1e-9)
            hit = {k for k, n in load.items() if n > 0 and residual[k] / n <= top}
            frozen = [
                f for f in unfrozen if limit.get(f, INF) <= top or any(k in hit for k in f.keys)
            ]
            self._freeze(frozen, level, unfrozen, followers, residual, load)

    def _capacity(self, link: tuple[str, str]) -> float:
        kind, host = link
        if kind == "m":
            return self.local_capacity
        return (self.up if kind == "u" else self.down).get(host, self.default_capacity)

    @staticmethod
    def _links(
        flows: Iterable[Flow],
    ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
        residual: dict[tuple[str, str], float] = {}
        load: dict[tuple[str, str], int] = {}
        for f in flows:
            for k, cap in zip(f.keys, f.caps, strict=True):
                if k in load:
                    load[k] += 1
                else:
                    residual[k], load[k] = cap, 1
        return residual, load

    @staticmethod
    def _freeze(
        flows: list[Flow],
        rate: float,
        unfrozen: dict[Flow, None],
        followers: dict[Flow, list[Flow]],
        residual: dict[tuple[str, str], float],
        load: dict[tuple[str, str], int],
    ) -> None:
        """Fix ``flows`` (and, transitively, their followers) at ``rate``."""
        stack = list(flows)
        while stack:
            f = stack.pop()
            if f in unfrozen:
                del unfrozen[f]
                f.rate = rate
                for k in f.keys:
                    residual[k] -= rate
                    load[k] -= 1
            stack.extend(g for g in followers.pop(f, ()) if g in unfrozen)
