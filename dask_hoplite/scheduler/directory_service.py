"""The RPC shell around the sans-IO :class:`~dask_hoplite.core.directory.ObjectDirectory`.

The directory decides, as plain data, who streams a large key to whom; it
never waits and never talks to anyone. This module is the part that does:
it answers workers' ``hoplite_request`` (parking a request in the directory's
queue until a sender frees up, or ``hoplite.directory.queue-timeout``), takes
their ``hoplite-finished`` / ``hoplite-released`` / ``hoplite-progress`` stream
messages (the last judges relays by their rate, :mod:`~dask_hoplite.core.relay_rates`,
and tells the workers of a lagging one's streams to reroute), feeds it
Dask's own events (a key's state changed, a worker left), hands each decision
to the request waiting for it, and reports its state (``hoplite_info``).

It knows nothing of the plugin: it gets the directory, the network model, the
configuration and a lookup of the scheduler's task states.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite._version import __version__
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.block_size import fitted_block
from dask_hoplite.core.byte_ranges import range_key
from dask_hoplite.core.directory import (
    Assign,
    Decision,
    Missing,
    ObjectDirectory,
    Queued,
    Reroute,
)
from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.measured_sizes import MeasuredSizes
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.core.protocol import PROTOCOL_VERSION
from dask_hoplite.core.relay_rates import REROUTE_OP, RelayRates
from dask_hoplite.core.shape_choice import choose_parts
from dask_hoplite.timeouts import wait_for_future

if TYPE_CHECKING:
    from distributed.scheduler import TaskState

logger = logging.getLogger(__name__)

#: Requests parked in the directory's queue: (key, receiver) -> its decision.
Waiting = dict[tuple[Key, str], asyncio.Future[Decision]]


def _decision_msg(d: Decision | None, nbytes: int) -> dict[str, Any]:
    """The answer for decision ``d`` (None: no sender freed up in time)."""
    if isinstance(d, Assign):
        return {
            "status": "assign",
            "sender": d.sender,
            "transfer_id": d.transfer_id,
            "nbytes": nbytes,
        }
    return {"status": "missing"}


class DirectoryService:
    """The directory's handlers and event inputs on the scheduler.

    ``task`` looks a key up in the scheduler's task states (``scheduler.tasks.get``);
    ``sizes``: the serialised sizes workers measured (a key's size is the
    larger of that and Dask's estimate).
    ``waiting`` is the map of parked requests, shared with a previous service
    when a newly registered plugin takes over (their decisions still reach them).
    ``hosts`` counts the cluster's hosts (the deepest a chain may become is
    every other one: the block each stream reads is fitted to it), and
    ``host_workers(address)`` the worker processes on that address's host
    (several share one copy of a key, :mod:`dask_hoplite.worker.host_sharing`).
    ``send(worker, msg)`` sends a message on the scheduler's stream to a
    worker, and ``log_event(topic, msg)`` is the scheduler's: with both, a
    relay that lags is rerouted (``hoplite.broadcast.slow-relay``).
    ``clock``: seconds, for the rates of progress reports.
    """

    def __init__(
        self,
        directory: ObjectDirectory,
        network: NetworkModel,
        config: HopliteConfig,
        task: Callable[[Key], TaskState | None],
        waiting: Waiting | None = None,
        sizes: MeasuredSizes | None = None,
        hosts: Callable[[], int] = lambda: 1,
        host_workers: Callable[[str], int] = lambda address: 1,
        send: Callable[[str, dict[str, Any]], None] | None = None,
        log_event: Callable[[str, Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._send = send
        self._log_event = log_event
        self._clock = clock
        #: Progress reports of running streams, to judge relays; None: off.
        self.relays: RelayRates | None = None
        if send is not None and config.slow_relay_ratio > 0:
            self.relays = RelayRates(
                config.slow_relay_window, config.slow_relay_ratio, config.slow_relay_min_lag
            )
        self._hosts = hosts
        self._host_workers = host_workers
        self.network = network
        self.config = config
        self._task = task
        self.waiting: Waiting = {} if waiting is None else waiting
        #: Serialised sizes workers measured where Dask's estimate is wrong.
        self.sizes = MeasuredSizes() if sizes is None else sizes
        #: Answers to requests, by status ("assign", "missing", "small", "error").
        self.answers: Counter[str] = Counter()
        #: Finished transfers, by outcome ("ok", "failed").
        self.transfers_finished: Counter[str] = Counter()
        #: Bytes of the transfers that finished ok.
        self.bytes_streamed = 0
        #: Keys whose first request found too few receivers to split them
        #: into byte ranges (split ones are in ``directory.ranges``).
        self.unsplit: set[Key] = set()

    # ---------------------------------------------------------- worker handlers

    async def request(
        self,
        key: Key,
        receiver: str,
        protocol: int | None = None,
        exclude: list[str] | None = None,
        part: list[int] | None = None,
    ) -> dict[str, Any]:
        """RPC ``hoplite_request``: a worker needs ``key`` (or needs another
        sender than those in ``exclude`` to resume from); whom to stream from.
        The first request of a key many workers wait for may split it into
        byte ranges: the answer is then ``{"status": "split", "parts": k}``,
        and the worker asks for each range ``part=[j, k]``."""
        answer = await self._answer(key, receiver, protocol, exclude, part)
        self.answers[answer["status"]] += 1
        return answer

    async def _answer(
        self,
        key: Key,
        receiver: str,
        protocol: int | None,
        exclude: list[str] | None,
        part: list[int] | None,
    ) -> dict[str, Any]:
        if protocol != PROTOCOL_VERSION:
            return {
                "status": "error",
                "message": f"protocol {protocol!r} != scheduler's {PROTOCOL_VERSION}",
            }
        ts = self._task(key)
        if ts is None or ts.state != "memory":
            # Not in memory anywhere (lost, being recomputed, or released):
            # the receiver's holders are stale; Dask finds the new copy.
            return {"status": "missing", "gone": True}
        nbytes = self.sizes.size(key, ts.nbytes)
        if nbytes < self.config.min_bytes:
            return {"status": "small"}
        holders = self._holders(key)
        parts = self._ranges(key, ts, receiver, holders, nbytes)
        if part is None and parts > 1:
            return {"status": "split", "parts": parts, "nbytes": nbytes, "holders": holders}
        if part is not None and (len(part) != 2 or part[1] != parts or not 0 <= part[0] < parts):
            return {
                "status": "error",
                "message": f"{key!r} is not split into {part[-1]} byte ranges",
                "holders": holders,
            }
        dkey = key if part is None else range_key(key, part[0], parts)
        decision: Decision | None = self.directory.request(dkey, receiver, holders, exclude or ())
        if isinstance(decision, Assign):
            # A planned sender was just assigned: those planned below it start.
            self._act(self.directory.drain(dkey))
        if isinstance(decision, Queued):
            # None: no sender freed up in time, and Dask's own path fetches it.
            decision = await self._wait_in_queue(dkey, receiver)
        logger.debug("%s asks for %r (excluding %s): %s", receiver, dkey, exclude, decision)
        msg = _decision_msg(decision, nbytes)
        if isinstance(decision, Assign):
            msg["block"] = self._block(nbytes, parts)
            # More than one: the workers of the host share one copy.
            msg["host_workers"] = self._host_workers(receiver)
        else:
            msg["gone"] = not self._in_memory(key)
        # Every answer names the holders as they are now: a receiver that
        # falls back to Dask's path must know who still holds the key, or it
        # takes the key for lost on its peer and asks again.
        msg["holders"] = self._holders(key)
        return msg

    def _ranges(
        self, key: Key, ts: TaskState, receiver: str, holders: list[str], nbytes: int
    ) -> int:
        """How many byte ranges ``key`` travels in (1: whole), decided at its
        first request from the workers whose tasks wait for it then
        (``hoplite.broadcast.ranges``; "auto": as many as
        :func:`~dask_hoplite.core.shape_choice.choose_parts` predicts fastest
        for their hosts, the size and the network model's estimate)."""
        known = self.directory.ranges.get(key)
        if known is not None:
            return known
        if key in self.unsplit or key in self.directory.objects:
            return 1
        receivers = {
            dts.processing_on.address
            for dts in ts.dependents or ()
            if dts.processing_on is not None
        }
        receivers = (receivers | {receiver}) - set(holders) - self.directory.outsiders
        setting = self.config.broadcast_ranges
        if setting is None:
            hosts = {host_of(a) for a in receivers} | {host_of(a) for a in holders[:1]}
            est = self.network.estimate()
            parts = choose_parts(
                "broadcast", len(hosts), nbytes, est.bandwidth, est.latency, self.config.block_bytes
            )
        else:
            parts = setting if len(receivers) >= 2 else 1
        if parts > 1:
            logger.info("%r goes to %d workers in %d byte ranges", key, len(receivers), parts)
            self.directory.split_ranges(key, parts, sorted(receivers))
        else:
            self.unsplit.add(key)
        return parts

    async def _wait_in_queue(self, key: Key, receiver: str) -> Decision | None:
        """The decision for a queued request, or None if none came within
        ``queue_timeout`` (the request is then withdrawn from the queue)."""
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self.waiting[(key, receiver)] = fut
        try:
            if self.directory.waits_for_plan(key, receiver):
                try:
                    return await wait_for_future(fut, self.config.plan_wait, shield=True)
                except asyncio.TimeoutError:
                    logger.debug("%s stops waiting for its planned sender of %r", receiver, key)
                    self._act(self.directory.unplan(key, receiver))
            # (A decision that comes as the wait runs out is kept: an
            # assignment must reach its receiver, or its transfer would hold
            # its sender's slot for good.)
            return await wait_for_future(fut, self.config.queue_timeout)
        except asyncio.TimeoutError:
            logger.info("request of %s for %r timed out in the queue", receiver, key)
            self.directory.cancel_request(key, receiver)
            return None
        finally:
            if self.waiting.get((key, receiver)) is fut:
                del self.waiting[(key, receiver)]

    def finished(
        self,
        transfer_id: int,
        ok: bool,
        worker: str | None = None,
        nbytes: int = 0,
        seconds: float = 0.0,
        latency: float = 0.0,
        parts: int = 1,
        **kwargs: Any,
    ) -> None:
        """Stream ``hoplite-finished``: a receiver's transfer ended (with its
        size and duration, and the receiver's latency, for the network model;
        a byte range of ``parts`` shared its receiver's NIC with the others,
        so its throughput counts ``parts`` times)."""
        self._act(self.directory.transfer_finished(transfer_id, bool(ok)))
        if self.relays is not None:
            self.relays.forget(transfer_id)
            if len(self.relays) > len(self.directory.transfers) + 64:
                self.relays.keep_only(self.directory.transfers)
        self.transfers_finished["ok" if ok else "failed"] += 1
        if ok:
            self.bytes_streamed += int(nbytes)
            self.network.observe_transfer(int(nbytes) * max(1, int(parts)), float(seconds))
            self.network.observe_latency(float(latency))

    def progress(
        self,
        transfer_id: int,
        position: int,
        at: float | None = None,
        worker: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Stream ``hoplite-progress``: the receiver of ``transfer_id`` has
        reached byte ``position`` at ``at`` seconds of its own host's
        monotonic clock (None: when the report arrives here). A relay whose
        rate says it holds its chain back is moved out of the way
        (:meth:`ObjectDirectory.reroute`).

        A transfer's reports all come from one host, so its rate is taken on
        that host's clock: the time a report spends in two busy event loops
        and the batched stream between them is no part of it. (Timed on
        arrival, a relay whose reports come in a bunch looks stuck, then
        fast.)"""
        relays, d = self.relays, self.directory
        t = d.transfers.get(transfer_id)
        if relays is None or t is None:
            return
        relays.observe(transfer_id, int(position), self._clock() if at is None else float(at))
        rec = d.objects.get(t.key)
        if rec is None or not rec.uploads.get(t.receiver):
            return  # a leaf holds nobody back
        parent = rec.incoming.get(t.sender)
        if parent is not None:
            lag = relays.lagging(transfer_id, parent.transfer_id, None)
        else:  # below a complete copy: the measured per-host bandwidth, if any
            est = self.network.estimate()
            lag = relays.lagging(transfer_id, None, est.bandwidth if est.measured else None)
        if lag is None:
            return
        logger.info(
            "%s lags as a relay of %r (%.3g B/s, its sender %.3g B/s): rerouting around it",
            t.receiver,
            t.key,
            lag.rate,
            lag.reference,
        )
        if self._log_event is not None:
            self._log_event(
                "hoplite",
                {
                    "action": "slow-relay",
                    "key": str(t.key),
                    "relay": t.receiver,
                    "sender": t.sender,
                    "rate": lag.rate,
                    "reference": lag.reference,
                },
            )
        for r in d.reroute(t.key, t.receiver):
            relays.forget(r.transfer_id)
            self._tell_reroute(r)

    def _tell_reroute(self, r: Reroute) -> None:
        assert self._send is not None
        self._send(
            r.receiver,
            {
                "op": REROUTE_OP,
                "key": r.key,
                "sender": r.sender,
                "transfer_id": r.transfer_id,
                "sender_lags": r.sender_lags,
            },
        )

    def plan_split(self, keys: list[Key], receivers: list[str]) -> dict[str, str]:
        """RPC ``hoplite_plan_split``: ``keys`` are the parts of an object
        that ``dask_hoplite.broadcast`` sends to ``receivers``; plan their trees."""
        self.directory.plan_split(list(keys), receivers)
        return {"status": "OK"}

    def released(self, key: Key, worker: str | None = None, **kwargs: Any) -> None:
        """Stream ``hoplite-released``: ``worker`` dropped its buffer of ``key``."""
        if worker is not None:
            self._act(self.directory.copy_released(key, worker))

    def info(self) -> dict[str, Any]:
        """RPC ``hoplite_info``: the directory's state, for tests and dashboards."""
        d = self.directory
        return {
            "version": __version__,
            "fanout": d.fanout,
            "objects": len(d),
            "transfers": len(d.transfers),
            "waiting": len(self.waiting),
            # how near a relay came to being rerouted (share of its sender's rate)
            "relay_closest": None if self.relays is None else self.relays.closest,
            "keys": [
                {
                    "key": rec.key,
                    "complete": sorted(rec.complete),
                    "partial": sorted(rec.incoming),
                    "peak_uploads": rec.peak_uploads,
                    "edges": [list(e) for e in rec.edges],
                }
                for rec in d.objects.values()
            ],
        }

    # ------------------------------------------------------- Dask's own events

    def key_transitioned(self, key: Key, start: str, finish: str, worker: object = None) -> None:
        """A task changed state on the scheduler (``worker``: the transition's
        ``worker`` argument, the new holder when it went to memory)."""
        if finish == "released":
            # Lost (its holders died: a recomputation follows, and the
            # partial copies keep streaming) or released by its clients (then
            # "forgotten" follows at once).
            if key in self.directory.objects:
                logger.debug("%r went %s -> released: no complete copy left", key, start)
            self._act(self.directory.lost(key))
        elif finish in ("forgotten", "erred"):
            self.unsplit.discard(key)
            self._act(self.directory.forget(key))
        elif finish == "memory" and isinstance(worker, str):
            self._act(self.directory.copy_added(key, worker))

    def worker_removed(self, address: str) -> None:
        """A worker left the cluster."""
        self._act(self.directory.worker_removed(address))

    # ------------------------------------------------------------------ helpers

    def _holders(self, key: Key) -> list[str]:
        """Dask's holders of ``key`` now."""
        ts = self._task(key)
        return [ws.address for ws in (ts.who_has or ())] if ts is not None else []

    def _block(self, nbytes: int, parts: int) -> int:
        """The block of a stream of ``nbytes`` in ``parts`` byte ranges, fitted
        to the deepest chain this cluster may build (:mod:`~dask_hoplite.core.block_size`)."""
        c = self.config
        return fitted_block(
            c.block_size_for(nbytes // parts),
            nbytes,
            max(0, self._hosts() - 1),
            self.network.estimate().bandwidth,
            c.pipeline_fill,
            c.min_block_bytes,
            parts,
        )

    def _in_memory(self, key: Key) -> bool:
        ts = self._task(key)
        return ts is not None and ts.state == "memory"

    def _act(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            fut = self.waiting.get((d.key, d.receiver))
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif isinstance(d, Assign):
                # Nobody waits any more: give the slot back.
                self._act(self.directory.transfer_finished(d.transfer_id, False))
            elif not isinstance(d, Missing):
                logger.debug("unclaimed directory decision %s", d)
