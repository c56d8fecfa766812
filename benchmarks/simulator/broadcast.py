"""Broadcast of one object from one worker to many, driven by the real
:class:`~dask_hoplite.core.directory.ObjectDirectory`, and Dask's default
(every receiver pulls a whole copy from the one holder) for comparison.

Hoplite: each receiver calls ``request`` when it arrives; an ``Assign`` starts a
flow from the sender's buffer (complete or partial: a partial sender limits the
flow, which stays a block behind it) after the setup latency; a completed flow
is reported with ``transfer_finished`` and Dask counts the receiver as a holder.
A worker that dies is reported with ``worker_removed``; the receivers it was
sending to ask again with it excluded and resume from the byte they reached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from benchmarks.simulator.engine import Engine
from benchmarks.simulator.network import Buffer, Flow, Network
from benchmarks.simulator.params import Cluster, address
from dask_hoplite.core.directory import Assign, Decision, Missing, ObjectDirectory

KEY = "x"


@dataclass
class Outcome:
    """What one simulated collective did."""

    seconds: float  # from t=0 to the last surviving receiver's last byte
    finish: dict[str, float] = field(default_factory=dict)
    resumes: int = 0  # streams restarted after a sender died
    bytes_kept: float = 0.0  # bytes resumed receivers did not need again
    repairs: int = 0  # reduce nodes replaced
    events: int = 0
    depth: int = 0  # longest chain of relays (broadcast) / tree height (reduce)


class HopliteBroadcast:
    """One broadcast from worker 0 to workers 1..n-1, in ``parts`` parts
    (``dask_hoplite.broadcast(..., parts=k)``: part ``j`` is a key of its
    own, and the directory follows the split-tree plan of ``plan_split``)."""

    def __init__(
        self,
        cluster: Cluster,
        n_workers: int,
        size: float,
        fanout: int = 1,
        parts: int = 1,
    ) -> None:
        self.cluster = cluster
        self.size = size
        self.part_size = size / parts
        self.net = Network(cluster.rate)
        self.engine = Engine(self.net)
        self.directory = ObjectDirectory(fanout=fanout, max_edges=0)
        self.source = address(0)
        self.receivers = [address(i) for i in range(1, n_workers)]
        self.keys = [f"{KEY}-{j}" for j in range(parts)] if parts > 1 else [KEY]
        if parts > 1:
            self.directory.plan_split(list(self.keys), self.receivers)
        workers = [self.source, *self.receivers]
        self.buffers = {k: {a: Buffer(self.part_size) for a in workers} for k in self.keys}
        for k in self.keys:
            self.buffers[k][self.source].pos = self.part_size
        self.holders = {k: {self.source} for k in self.keys}  # Dask's complete copies
        self.parts_done: dict[str, int] = {}
        self.flows: dict[int, tuple[str, Flow]] = {}  # (key, stream) by transfer id
        self.history: list[Flow] = []  # every stream started, in order
        self.dead: set[str] = set()
        self.exclude: dict[tuple[str, str], set[str]] = {}
        self.outcome = Outcome(0.0)

    def run(
        self,
        arrivals: Mapping[str, float] | None = None,
        failures: Mapping[str, float] | None = None,
    ) -> Outcome:
        for r in self.receivers:
            t = 0.0 if arrivals is None else arrivals[r]
            for k in self.keys:
                self.engine.at(t, partial(self._request, k, r))
        for w, t in (failures or {}).items():
            self.engine.at(t, partial(self._fail, w))
        self.engine.run()
        live = [r for r in self.receivers if r not in self.dead]
        missing = [r for r in live if r not in self.outcome.finish]
        if missing:
            raise RuntimeError(f"{len(missing)} receivers never completed, e.g. {missing[0]}")
        self.outcome.seconds = max(self.outcome.finish[r] for r in live)
        self.outcome.events = self.engine.events
        return self.outcome

    def _request(self, key: str, receiver: str, now: float) -> None:
        if receiver in self.dead:
            return
        exclude = self.exclude.get((key, receiver), ())
        d = self.directory.request(key, receiver, self.holders[key], exclude=exclude)
        # As the scheduler's directory service: a planned sender just
        # assigned lets the receivers planned below it start.
        self._act([d, *self.directory.drain(key)], now)

    def _act(self, decisions: Sequence[Decision], now: float) -> None:
        for d in decisions:
            if isinstance(d, Missing):
                raise RuntimeError(f"{d.receiver} found no copy: the source died?")
            if not isinstance(d, Assign):
                continue  # Queued: the directory assigns it when capacity frees
            key = str(d.key)
            bufs = self.buffers[key]
            flow = Flow(
                d.sender,
                d.receiver,
                bufs[d.receiver],
                sources=(bufs[d.sender],),
                # A part's streams get 1/parts of a NIC: the source sends
                # every part at once, an inner node ``parts`` streams.
                lag=self.cluster.lag(self.part_size, streams=len(self.keys)),
                start=now + self.cluster.overheads.setup,
                on_done=partial(self._done, d.transfer_id, key),
            )
            self.flows[d.transfer_id] = (key, self.net.add(flow))
            self.history.append(flow)
            depth = self.directory.transfers[d.transfer_id].depth
            self.outcome.depth = max(self.outcome.depth, depth)

    def _done(self, tid: int, key: str, flow: Flow, now: float) -> None:
        del self.flows[tid]
        n = self.parts_done[flow.dst] = self.parts_done.get(flow.dst, 0) + 1
        if n == len(self.keys):
            self.outcome.finish[flow.dst] = now
        self.holders[key].add(flow.dst)
        self._act(self.directory.transfer_finished(tid, ok=True), now)

    def _fail(self, worker: str, now: float) -> None:
        """``worker`` dies: its streams break, its receivers resume elsewhere."""
        self.dead.add(worker)
        for h in self.holders.values():
            h.discard(worker)
        self.net.remove_host(worker)
        orphans = [(k, f.dst) for k, f in self.flows.values() if f.src == worker]
        self.flows = {t: kf for t, kf in self.flows.items() if worker not in (kf[1].src, kf[1].dst)}
        self._act(self.directory.worker_removed(worker), now)
        for key, r in orphans:
            self.outcome.resumes += 1
            self.outcome.bytes_kept += self.buffers[key][r].pos
            self.exclude.setdefault((key, r), set()).add(worker)
            # The broken stream is seen at once (a TCP error); asking again
            # costs the setup latency the Assign adds.
            self._request(key, r, now)


def hoplite_broadcast(
    cluster: Cluster,
    n_workers: int,
    size: float,
    arrivals: Mapping[str, float] | None = None,
    failures: Mapping[str, float] | None = None,
    fanout: int = 1,
    parts: int = 1,
) -> Outcome:
    return HopliteBroadcast(cluster, n_workers, size, fanout, parts).run(arrivals, failures)


def dask_broadcast(
    cluster: Cluster,
    n_workers: int,
    size: float,
    concurrency: int = 10,
    arrivals: Mapping[str, float] | None = None,
) -> Outcome:
    """Dask's default: every receiver fetches a whole copy from worker 0, which
    serves ``concurrency`` (``distributed.worker.connections.incoming``) at once;
    the others wait for a slot (Dask's busy/retry loop, taken as instant)."""
    net = Network(cluster.rate)
    engine = Engine(net)
    source = Buffer(size, size)
    waiting: list[str] = []
    serving: set[str] = set()
    out = Outcome(0.0)

    def start(r: str, now: float) -> None:
        if len(serving) >= concurrency:
            waiting.append(r)
            return
        serving.add(r)
        net.add(
            Flow(
                address(0),
                r,
                Buffer(size),
                sources=(source,),
                start=now + cluster.overheads.setup,
                on_done=done,
            )
        )

    def done(f: Flow, now: float) -> None:
        serving.discard(f.dst)
        out.finish[f.dst] = now
        if waiting:
            start(waiting.pop(0), now)

    for i in range(1, n_workers):
        r = address(i)
        engine.at(0.0 if arrivals is None else arrivals[r], partial(start, r))
    engine.run()
    out.seconds = max(out.finish.values())
    out.events = engine.events
    return out
