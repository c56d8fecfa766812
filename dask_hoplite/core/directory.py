"""The object directory: who holds which key, completely or partially, and who
streams from whom.

A sans-IO core in the style of ``distributed.worker_state_machine``: the
scheduler plugin feeds it events (a worker asks for a sender, a transfer ended,
a copy was released, a worker left, Dask forgot a key) and acts on the
decisions it returns. Nothing here touches a socket or an event loop, so every
rule is unit- and property-tested deterministically (``tests/test_directory.py``).

The rules follow Hoplite (Zhuang et al., SIGCOMM 2021):

* A receiver counts as a holder the moment it is assigned a sender, before it
  has a byte: it serves later receivers from its partially filled buffer, so
  receivers that arrive together form a pipelined chain and late receivers
  attach wherever there is spare upload capacity.
* Planning is per host, since workers of one host share one NIC (Dask often
  runs several workers per machine). A key enters a host once over the
  network: a receiver whose host already has a copy, complete or partial,
  takes it from there (over loopback) and waits for one of them rather than
  pull the key across the NIC a second time.
* A host's NIC carries at most ``fanout`` streams of one key to other hosts
  at once; besides, each holder streams to at most ``fanout`` receivers on
  its own host.
* Idle complete copies are preferred; then the partial copy closest to a
  complete one (most bytes, by construction); a partial copy downstream of the
  requester is never chosen (it depends on the requester: deadlock).
* With every holder saturated, the request queues until capacity frees; the
  senders it gave up on stay excluded when it is served.
* A key may carry a plan (:meth:`ObjectDirectory.plan_split`: one part of a
  split-tree broadcast, :mod:`dask_hoplite.core.split_trees`): a planned
  receiver streams from its planned sender, waiting for it to be assigned
  first if need be, whatever the fan-out count says; a receiver whose planned
  sender died or was given up falls back to the rules above.
* A key may be split into byte ranges (:meth:`ObjectDirectory.split_ranges`,
  :mod:`dask_hoplite.core.byte_ranges`): each range is a record of its own,
  planned as one part of a split-tree broadcast and asked for by range
  (:func:`~dask_hoplite.core.byte_ranges.range_key`); Dask's events about the
  key (a copy added, released, lost, forgotten) reach every range.
* A relay that holds its chain back (its rate, :mod:`dask_hoplite.core.relay_rates`)
  is moved out of the way (:meth:`ObjectDirectory.reroute`): its receivers
  resume from its sender, and it resumes as a leaf wherever a sender has
  spare upload; it serves nobody else of that key while another copy can.
* When Dask loses every complete copy (its holders died), the partial copies
  keep streaming from one another and stay on record: the recomputed copy
  and the receivers that come back join the tree that is still running.

Copies are keyed by worker address; hosts come from the addresses
(:func:`dask_hoplite.core.hosts.host_of`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dask.typing import Key  # noqa: E402

from dask_hoplite.core.byte_ranges import range_key
from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.split_trees import SplitPart, split_tree_parents


@dataclass(frozen=True)
class Assign:
    """Decision: ``receiver`` streams ``key`` from ``sender``."""

    key: Key
    receiver: str
    sender: str
    transfer_id: int


@dataclass(frozen=True)
class Queued:
    """Decision: every holder of ``key`` is saturated; ``receiver`` waits."""

    key: Key
    receiver: str


@dataclass(frozen=True)
class Missing:
    """Decision: no copy of ``key`` is known (anymore); ``receiver`` must use
    Dask's own path, which knows how to wait for or recompute the key."""

    key: Key
    receiver: str


@dataclass(frozen=True)
class Reroute:
    """Decision: ``receiver`` must drop its stream of ``key`` from ``sender``
    (``transfer_id``) and ask again from the byte it reached: without
    ``sender`` if ``sender_lags``, else as the lagging relay itself."""

    key: Key
    receiver: str
    sender: str
    transfer_id: int
    sender_lags: bool


Decision = Assign | Queued | Missing


@dataclass
class Transfer:
    transfer_id: int
    key: Key
    sender: str
    receiver: str
    depth: int  # 1 for a receiver of a complete copy, +1 per partial hop


@dataclass
class ObjectRecord:
    """What the directory knows of one key."""

    key: Key
    #: Copies completed through hoplite (Dask's own holders are passed in with
    #: every request, since Dask's state is the authority on them).
    complete: set[str] = field(default_factory=set)
    #: Dask's holders as of the latest request.
    holders: set[str] = field(default_factory=set)
    #: Active transfers by receiver address (one per receiver).
    incoming: dict[str, Transfer] = field(default_factory=dict)
    #: Active outgoing streams per sender address.
    uploads: dict[str, int] = field(default_factory=dict)
    #: Active streams leaving each host for another host (per NIC).
    nic_uploads: dict[str, int] = field(default_factory=dict)
    #: Active streams per sender address to receivers on the sender's host.
    local_uploads: dict[str, int] = field(default_factory=dict)
    #: Receivers waiting for capacity, in arrival order, each with the
    #: senders it gave up on (which stay excluded when it is served later).
    queue: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Highest number of concurrent streams any single holder served.
    peak_uploads: int = 0
    #: Every (sender, receiver) edge this key travelled, for inspection.
    edges: list[tuple[str, str]] = field(default_factory=list)
    #: Planned sender per receiver (a split-tree broadcast's part), if any.
    planned: dict[str, str] = field(default_factory=dict)
    #: All parts of that broadcast (this key among them); empty otherwise.
    siblings: tuple[Key, ...] = ()
    #: Relays moved out of the chain for lagging (:meth:`ObjectDirectory.reroute`):
    #: senders of last resort.
    slow: set[str] = field(default_factory=set)

    def copies(self) -> set[str]:
        return self.complete | self.holders

    def has_copy(self, address: str) -> bool:
        """``address`` holds the whole key (without building :meth:`copies`)."""
        return address in self.complete or address in self.holders


class ObjectDirectory:
    """Complete and partial copies per key, and sender assignment.

    Parameters
    ----------
    fanout:
        Concurrent outgoing streams of one key from one holder.
    max_edges:
        How many (sender, receiver) edges are remembered per key for
        inspection; the oldest are dropped beyond it.
    """

    def __init__(self, fanout: int = 1, max_edges: int = 1024) -> None:
        if fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}")
        self.fanout = fanout
        self.max_edges = max_edges
        self.objects: dict[Key, ObjectRecord] = {}
        self.transfers: dict[int, Transfer] = {}
        #: Keys announced as parts of a split-tree broadcast, not yet requested.
        self.split_parts: dict[Key, SplitPart] = {}
        #: Dask's keys split into byte ranges: how many ranges.
        self.ranges: dict[Key, int] = {}
        #: Workers that cannot send (no running transport there): never
        #: assigned as senders; what they hold travels Dask's way.
        self.outsiders: set[str] = set()
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ events

    def plan_split(self, keys: list[Key], receivers: Iterable[str]) -> None:
        """``keys[j]`` is part ``j`` of an object broadcast to ``receivers``
        in ``len(keys)`` parts: at each key's first request its receivers get
        the senders :func:`~dask_hoplite.core.split_trees.split_tree_parents`
        plans from the holder it has then."""
        rs = tuple(dict.fromkeys(receivers))
        for j, key in enumerate(keys):
            self.split_parts[key] = SplitPart(j, tuple(keys), rs)

    def split_ranges(self, key: Key, parts: int, receivers: Iterable[str]) -> None:
        """Dask's ``key`` travels in ``parts`` byte ranges from now on, each
        down the tree of one part of a split-tree broadcast to ``receivers``
        (planned from the holder at each range's first request); ask for
        range ``j`` as :func:`~dask_hoplite.core.byte_ranges.range_key`."""
        if parts < 2:
            raise ValueError(f"a key is split into 2 ranges or more, not {parts}")
        self.ranges[key] = parts
        self.plan_split([range_key(key, j, parts) for j in range(parts)], receivers)

    def records_of(self, key: Key) -> list[Key]:
        """The directory keys of Dask's ``key``: its own, or its ranges'."""
        parts = self.ranges.get(key)
        return [key] if parts is None else [range_key(key, j, parts) for j in range(parts)]

    def request(
        self,
        key: Key,
        receiver: str,
        holders: Iterable[str],
        exclude: Iterable[str] = (),
    ) -> Decision:
        """``receiver`` needs ``key``; ``holders`` are Dask's complete replicas.

        ``exclude``: senders the receiver gave up on (dead or stalled) while it
        resumes a partially received copy; they are not assigned again for
        this request, and their partial copies are not assigned to anyone
        (every one of them may be waiting for the same stalled sender)."""
        rec = self.objects.get(key)
        if rec is None:
            rec = self.objects[key] = ObjectRecord(key)
        rec.holders = set(holders)
        exclude = frozenset(exclude) | self.outsiders
        split = self.split_parts.get(key)
        if split is not None and rec.holders - self.outsiders:
            del self.split_parts[key]
            source = min(rec.holders - self.outsiders)
            plans = split_tree_parents(source, split.receivers, len(split.keys))
            rec.planned, rec.siblings = plans[split.part], split.keys
        existing = rec.incoming.get(receiver)
        if existing is not None:
            # The receiver asks again while its transfer is active: it gave up
            # on that stream (it would report failure first in the normal case).
            self._end_transfer(rec, existing)
        if receiver in rec.queue:
            rec.queue[receiver] |= frozenset(exclude)
            return Queued(key, receiver)
        decision = self._assign(rec, receiver, exclude)
        if isinstance(decision, Queued):
            rec.queue[receiver] = exclude
        elif isinstance(decision, Missing) and not rec.incoming and not rec.complete:
            del self.objects[key]
        return decision

    def transfer_finished(self, transfer_id: int, ok: bool) -> list[Decision]:
        """The transfer ended: ``ok`` means the receiver holds a complete copy."""
        t = self.transfers.get(transfer_id)
        if t is None:
            return []
        rec = self.objects[t.key]
        self._end_transfer(rec, t)
        if ok:
            rec.complete.add(t.receiver)
        decisions = self._drain(rec)
        self._maybe_drop(rec)
        return decisions

    def reroute(self, key: Key, relay: str) -> list[Reroute]:
        """``relay`` holds its chain of ``key`` back (its rate fell well below
        its sender's): its receivers drop their streams from it, the first
        of them planned onto ``relay``'s own sender (whose upload this frees),
        the others served by the usual rules; ``relay`` drops its own stream
        and is planned as a leaf below a copy with spare upload
        (:meth:`_leaf_for`: for a chain, its tail). Both ends ask again, and
        ``relay`` serves nobody else of ``key`` while another copy can. The
        last decision is ``relay``'s own."""
        rec = self.objects.get(key)
        t = None if rec is None else rec.incoming.get(relay)
        if rec is None or t is None:
            return []
        rec.slow.add(relay)
        out = []
        children = [c for c in rec.incoming.values() if c.sender == relay]
        for i, child in enumerate(children):
            self._end_transfer(rec, child)
            if i == 0:
                rec.planned[child.receiver] = t.sender
            out.append(Reroute(key, child.receiver, relay, child.transfer_id, sender_lags=True))
        self._end_transfer(rec, t)
        leaf = self._leaf_for(rec, relay, [c.receiver for c in children], t.sender)
        if leaf is not None:
            rec.planned[relay] = leaf
        out.append(Reroute(key, relay, t.sender, t.transfer_id, sender_lags=False))
        self._maybe_drop(rec)
        return out

    def _leaf_for(self, rec: ObjectRecord, relay: str, moved: list[str], kept: str) -> str | None:
        """Where a relay moved out of its chain goes: an idle complete copy,
        else the deepest partial copy with spare upload (a receiver in
        ``moved``, whose streams were just cut, counts as one once it has no
        receivers of its own); never ``kept``, the relay's sender, whose
        upload its receivers take; None: the usual rules, later."""
        idle = sorted(
            a
            for a in rec.copies() - rec.slow - {relay, kept}
            if rec.uploads.get(a, 0) < self.fanout and a not in rec.incoming
        )
        if idle:
            return idle[0]
        spare = [
            (t.depth, t.receiver)
            for t in rec.incoming.values()
            if t.receiver not in rec.slow | {kept} and rec.uploads.get(t.receiver, 0) < self.fanout
        ]
        spare += [(0, m) for m in moved if not rec.uploads.get(m, 0)]
        return max(spare)[1] if spare else None

    def drain(self, key: Key) -> list[Decision]:
        """Serve the receivers of ``key`` planned to stream from a sender
        that was just assigned (call it after a request that got an
        ``Assign``), and a rerouted relay waiting for a spare upload (the
        receiver just assigned has one); nothing otherwise, as a key's queue
        only moves when a stream ends or a copy is added."""
        rec = self.objects.get(key)
        if rec is None or not (rec.planned or (rec.slow and rec.queue)):
            return []
        return self._drain(rec)

    def waits_for_plan(self, key: Key, receiver: str) -> bool:
        """Whether ``receiver`` is queued for its planned sender of ``key``."""
        rec = self.objects.get(key)
        return rec is not None and receiver in rec.queue and receiver in rec.planned

    def unplan(self, key: Key, receiver: str) -> list[Decision]:
        """``receiver`` waited long enough for its planned sender (which may
        wait for a key ``receiver`` itself fetches only later): the
        directory's own rules serve it from now on."""
        rec = self.objects.get(key)
        if rec is None or rec.planned.pop(receiver, None) is None:
            return []
        return self._drain(rec)

    def cancel_request(self, key: Key, receiver: str) -> None:
        """A queued receiver stopped waiting (timeout, or it went away)."""
        rec = self.objects.get(key)
        if rec is not None and receiver in rec.queue:
            del rec.queue[receiver]
            self._maybe_drop(rec)

    def copy_added(self, key: Key, address: str) -> list[Decision]:
        """Dask has a new complete copy of ``key`` on ``address`` (a task
        finished, possibly a recomputation): serve receivers waiting for one."""
        return [d for k in self.records_of(key) for d in self._copy_added(k, address)]

    def _copy_added(self, key: Key, address: str) -> list[Decision]:
        rec = self.objects.get(key)
        if rec is None:
            return []
        rec.holders.add(address)
        return self._drain(rec)

    def copy_released(self, key: Key, address: str) -> list[Decision]:
        """``address`` no longer holds ``key`` (Dask released it there)."""
        return [d for k in self.records_of(key) for d in self._copy_released(k, address)]

    def _copy_released(self, key: Key, address: str) -> list[Decision]:
        rec = self.objects.get(key)
        if rec is None:
            return []
        rec.complete.discard(address)
        rec.holders.discard(address)
        decisions = self._drain(rec)
        self._maybe_drop(rec)
        return decisions

    def worker_removed(self, address: str) -> list[Decision]:
        """A worker left the cluster: all its copies and streams are gone."""
        decisions: list[Decision] = []
        for key, split in self.split_parts.items():
            if address in split.receivers:
                rs = tuple(r for r in split.receivers if r != address)
                self.split_parts[key] = SplitPart(split.part, split.keys, rs)
        for rec in list(self.objects.values()):
            rec.complete.discard(address)
            rec.holders.discard(address)
            rec.queue.pop(address, None)
            # Its planned receivers fall back to the directory's own rules.
            rec.planned = {r: s for r, s in rec.planned.items() if address not in (r, s)}
            for t in list(rec.incoming.values()):
                if address in (t.sender, t.receiver):
                    self._end_transfer(rec, t)
            decisions.extend(self._drain(rec))
            self._maybe_drop(rec)
        return decisions

    def lost(self, key: Key) -> list[Decision]:
        """Dask lost every complete copy of ``key`` (their workers died) and
        recomputes it. The partial copies streaming from one another keep
        streaming: they stay on record, so that the recomputed copy and the
        receivers that come back find a tree that is still running, and no
        relay is given a second receiver it cannot serve at full speed.
        Queued receivers are released to Dask's path, which waits for the
        recomputation."""
        return [d for k in self.records_of(key) for d in self._lost(k)]

    def _lost(self, key: Key) -> list[Decision]:
        rec = self.objects.get(key)
        if rec is None:
            return []
        rec.complete.clear()
        rec.holders.clear()
        out: list[Decision] = [Missing(key, r) for r in rec.queue]
        rec.queue.clear()
        self._maybe_drop(rec)
        return out

    def forget(self, key: Key) -> list[Decision]:
        """Dask released ``key`` everywhere: drop everything about it."""
        keys = self.records_of(key)
        self.ranges.pop(key, None)
        return [d for k in keys for d in self._forget(k)]

    def _forget(self, key: Key) -> list[Decision]:
        self.split_parts.pop(key, None)
        rec = self.objects.pop(key, None)
        if rec is None:
            return []
        for t in rec.incoming.values():
            self.transfers.pop(t.transfer_id, None)
        return [Missing(key, r) for r in rec.queue]

    # --------------------------------------------------------------- queries

    def pinned(self, key: Key) -> set[str]:
        """Workers whose copy of ``key`` (any of its ranges) an active stream
        reads from or writes to."""
        out: set[str] = set()
        for k in self.records_of(key):
            rec = self.objects.get(k)
            if rec is not None:
                out.update(a for a, n in rec.uploads.items() if n > 0)
                out.update(rec.incoming)
        return out

    def upstream(self, key: Key, receiver: str) -> Iterator[str]:
        """The chain of senders above ``receiver``, nearest first."""
        rec = self.objects.get(key)
        seen = {receiver}
        while rec is not None:
            t = rec.incoming.get(receiver)
            if t is None or t.sender in seen:
                return
            yield t.sender
            seen.add(t.sender)
            receiver = t.sender

    def __len__(self) -> int:
        return len(self.objects)

    # -------------------------------------------------------------- internals

    def _assign(
        self, rec: ObjectRecord, receiver: str, exclude: frozenset[str] = frozenset()
    ) -> Decision:
        if rec.slow - exclude - {receiver}:
            # Relays moved out for lagging serve only when nobody else can.
            decision = self._assign_from(rec, receiver, exclude | rec.slow)
            if not isinstance(decision, Missing):
                return decision
        return self._assign_from(rec, receiver, exclude)

    def _assign_from(self, rec: ObjectRecord, receiver: str, exclude: frozenset[str]) -> Decision:
        if receiver in rec.planned:
            planned = self._planned(rec, receiver, exclude)
            if planned is not None:
                return planned
        # A holder that is itself still receiving serves from its partial
        # buffer: it counts as partial (and may depend on the requester).
        copies = rec.copies() - {receiver} - rec.incoming.keys() - exclude
        streaming = [
            t
            for r, t in rec.incoming.items()
            if r != receiver and r not in exclude and t.sender not in exclude
        ]
        if not copies and not streaming:
            return Missing(rec.key, receiver)
        partial = [t for t in streaming if not self._depends_on(rec, t.receiver, receiver)]
        host = host_of(receiver)
        local_copies = [a for a in copies if host_of(a) == host]
        local_partial = [t for t in partial if host_of(t.receiver) == host]
        if local_copies or local_partial:
            # The key is on this host already, or on its way in: take it from
            # there, or wait for it; never across the NIC a second time. A
            # copy that came through hoplite first: on a host whose workers
            # share, it is in a region the receiver maps as it is, where a
            # copy only Dask knows of (its task's output, say) is copied
            # into one first.
            return self._pick(
                rec, receiver, local_copies, local_partial, rec.local_uploads, prefer=rec.complete
            )
        if rec.siblings:
            spare = self._spare_slot(rec, receiver, list(copies), partial)
            if spare is not None:
                return spare
        return self._pick(rec, receiver, list(copies), partial, rec.nic_uploads, by_host=True)

    def _spare_slot(
        self, rec: ObjectRecord, receiver: str, copies: list[str], partial: list[Transfer]
    ) -> Assign | None:
        """A sender for a part of a split-tree broadcast off its plan (its
        planned sender died): the nearest copy whose host sends fewer than
        ``parts`` streams of all the parts together. Every NIC carries
        ``parts`` streams in the plan; a dead worker frees one slot in each
        part's tree above it, as many as its children need."""

        def load(a: str) -> int:
            h = host_of(a)
            return sum(
                self.objects[k].nic_uploads.get(h, 0) for k in rec.siblings if k in self.objects
            )

        options = [(0, load(a), a) for a in copies]
        options += [(t.depth, load(t.receiver), t.receiver) for t in partial]
        options = [o for o in options if o[1] < len(rec.siblings)]
        if not options:
            return None
        depth, _, sender = min(options)
        return self._start(rec, sender, receiver, depth=depth + 1)

    def _planned(
        self, rec: ObjectRecord, receiver: str, exclude: frozenset[str]
    ) -> Assign | Queued | None:
        """Its planned sender, if it can serve (None: the plan is dropped for
        this receiver, which the directory's rules serve)."""
        planned = rec.planned[receiver]
        t = rec.incoming.get(planned)
        if planned in exclude:
            pass  # given up on
        elif not rec.siblings and not self._has_room(rec, planned, receiver):
            pass  # a reroute's plan, its sender's upload taken meanwhile
        elif t is not None:
            if t.sender not in exclude and not self._depends_on(rec, planned, receiver):
                return self._start(rec, planned, receiver, depth=t.depth + 1)
        elif rec.has_copy(planned):
            return self._start(rec, planned, receiver, depth=1)
        else:
            return Queued(rec.key, receiver)  # until its sender is assigned
        del rec.planned[receiver]
        return None

    def _pick(
        self,
        rec: ObjectRecord,
        receiver: str,
        copies: list[str],
        partial: list[Transfer],
        busy: dict[str, int],
        by_host: bool = False,
        prefer: set[str] | frozenset[str] = frozenset(),
    ) -> Decision:
        """The best sender with capacity left, counted in ``busy`` per sender
        address (or per sender host if ``by_host``): the complete copy with
        the fewest streams out (of those, one in ``prefer``), else the
        shallowest partial one."""

        def free(a: str) -> bool:
            return busy.get(host_of(a) if by_host else a, 0) < self.fanout

        idle = [a for a in copies if free(a)]
        if idle:
            sender = min(idle, key=lambda a: (rec.uploads.get(a, 0), a not in prefer, a))
            return self._start(rec, sender, receiver, depth=1)
        candidates = [t for t in partial if free(t.receiver)]
        if candidates:
            best = min(candidates, key=lambda t: (t.depth, t.transfer_id))
            return self._start(rec, best.receiver, receiver, depth=best.depth + 1)
        return Queued(rec.key, receiver)

    def _has_room(self, rec: ObjectRecord, sender: str, receiver: str) -> bool:
        """Whether ``sender`` may start one more stream to ``receiver`` within
        the fan-out (per NIC across hosts, per holder within one)."""
        return all(
            counts.get(name, 0) < self.fanout
            for counts, name in _counters(rec, sender, receiver)[1:]
        )

    def _depends_on(self, rec: ObjectRecord, node: str, receiver: str) -> bool:
        """True if ``node`` streams (directly or through relays) from ``receiver``."""
        return receiver in self.upstream(rec.key, node)

    def _start(self, rec: ObjectRecord, sender: str, receiver: str, depth: int) -> Assign:
        t = Transfer(next(self._ids), rec.key, sender, receiver, depth)
        self.transfers[t.transfer_id] = t
        rec.incoming[receiver] = t
        for counts, name in _counters(rec, sender, receiver):
            counts[name] = counts.get(name, 0) + 1
        rec.peak_uploads = max(rec.peak_uploads, rec.uploads[sender])
        rec.edges.append((sender, receiver))
        if len(rec.edges) > self.max_edges:
            del rec.edges[: len(rec.edges) - self.max_edges]
        return Assign(rec.key, receiver, sender, t.transfer_id)

    def _end_transfer(self, rec: ObjectRecord, t: Transfer) -> None:
        self.transfers.pop(t.transfer_id, None)
        if rec.incoming.get(t.receiver) is t:
            del rec.incoming[t.receiver]
        for counts, name in _counters(rec, t.sender, t.receiver):
            n = counts.get(name, 0) - 1
            if n > 0:
                counts[name] = n
            else:
                counts.pop(name, None)

    def _drain(self, rec: ObjectRecord) -> list[Decision]:
        """Serve queued receivers now that something changed."""
        out: list[Decision] = []
        progress = True
        while progress and rec.queue:
            # Again after a pass that served someone: a receiver served late
            # in the pass may be the planned sender of one before it.
            progress = False
            for receiver, exclude in list(rec.queue.items()):
                # In arrival order; one that must still wait (every sender it
                # may take is busy or excluded) does not hold up those behind it.
                decision = self._assign(rec, receiver, exclude)
                if isinstance(decision, Queued):
                    continue
                del rec.queue[receiver]
                out.append(decision)
                progress = bool(rec.planned)
        return out

    def _maybe_drop(self, rec: ObjectRecord) -> None:
        if not (rec.complete or rec.holders or rec.incoming or rec.queue):
            self.objects.pop(rec.key, None)


def _counters(rec: ObjectRecord, sender: str, receiver: str) -> list[tuple[dict[str, int], str]]:
    """The counts a stream from ``sender`` to ``receiver`` is in: its
    sender's uploads, and its sender's local uploads (same host) or its
    sender host's NIC uploads (another host)."""
    h = host_of(sender)
    if h == host_of(receiver):
        return [(rec.uploads, sender), (rec.local_uploads, sender)]
    return [(rec.uploads, sender), (rec.nic_uploads, h)]
