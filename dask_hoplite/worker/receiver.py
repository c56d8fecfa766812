"""Receiving large keys: fetch with resume.

:class:`Receiver` streams a key into this worker's block store from the sender
the directory assigns; when that sender dies or stalls it resumes from the
byte reached with another sender (never one downstream of this worker), and
restarts from byte 0 only if the new sender holds another object.
:func:`get_data_or_reschedule` is Dask's own fetch, for what hoplite cannot
get. :mod:`dask_hoplite.worker.fetch_paths` puts the receiver under Dask's
fetch paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed import Reschedule
from distributed.comm.core import CommClosedError
from distributed.metrics import context_meter
from distributed.metrics import time as dask_time
from distributed.worker import Worker

from dask_hoplite.compat import private
from dask_hoplite.core.byte_ranges import range_bounds
from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.protocol import PROTOCOL_VERSION, StreamRequest
from dask_hoplite.core.relay_rates import PROGRESS_OP
from dask_hoplite.core.store import BufferState, ObjectBuffer
from dask_hoplite.errors import LayoutChanged, SenderBusy, TransferFailed
from dask_hoplite.worker import accounting
from dask_hoplite.worker.context import WorkerContext
from dask_hoplite.worker.streams import forget_frames, pooled_comm, raw_stream, receive_stream
from dask_hoplite.worker.timelines import Timelines

if TYPE_CHECKING:
    from distributed.worker import get_data_from_worker
else:  # a name a release dropped turns off its feature, not this import
    get_data_from_worker = private("distributed.worker", "get_data_from_worker")

logger = logging.getLogger(__name__)

#: ``fetch`` result: the key is in memory nowhere (lost, being recomputed).
GONE = object()
_FAILED = object()  # a stream ended without the whole object: resume elsewhere
_RESTART = object()  # the sender holds another object: start over
_RANGE_DONE = object()  # a byte range is in
_BUSY = object()  # the sender is at Dask's limit of transfers out
_REROUTED = object()  # the directory moved this stream off a lagging relay
_MOVED = object()  # ... or moved this worker, a lagging relay, out of its chain


class Receiver:
    """Fetches keys into this worker's block store, resuming across senders."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        #: Keys being fetched here, with a future set when the fetch ends.
        self.fetching: dict[Key, asyncio.Future[None]] = {}
        #: Holders of keys hoplite gave up on, as the scheduler saw them then.
        self.holders: dict[Key, list[str]] = {}
        #: The sender each key fetched here came from last (this worker's
        #: address for a copy it had already), for Dask's story of the fetch.
        self.senders: dict[Key, str] = {}
        #: The comms of the streams running here, by transfer id (to drop
        #: one the directory reroutes), and the transfers it rerouted.
        self._comms: dict[int, Any] = {}
        self._rerouted: dict[int, object] = {}

    def reroute(
        self,
        key: Key = "",
        sender: str = "",
        transfer_id: int = 0,
        sender_lags: bool = True,
        **_: Any,
    ) -> None:
        """Stream handler ``hoplite-reroute``: the directory moved this
        worker's stream of ``key`` off ``sender``, as one of the two lags as
        a relay (:mod:`~dask_hoplite.core.relay_rates`): drop it, and the
        fetch asks again from the byte it reached, without ``sender`` if
        ``sender_lags`` (else this worker is the relay moved out, and its
        sender is fine). A stream that ended meanwhile has nothing to drop."""
        comm = self._comms.get(transfer_id)
        if comm is None:
            logger.debug("reroute of %r from %s: its stream is over", key, sender)
            return
        logger.info("rerouting the stream of %r from %s", key, sender)
        self._rerouted[transfer_id] = _REROUTED if sender_lags else _MOVED
        comm.abort()

    def is_fetching(self, key: Key) -> bool:
        return key in self.fetching

    def drop_untracked(self, key: Key) -> None:
        """Drop our copy of ``key``, which Dask does not track here (so no
        transition of Dask's would), and tell the directory; streams reading
        it from us finish from the buffer they hold."""
        if key in self.fetching:
            return  # another local fetch of it runs; it decides
        self.ctx.store.release(key)
        self.ctx.send({"op": "hoplite-released", "key": key})

    async def fetch(self, key: Key) -> tuple[bool, Any]:
        """Fetch ``key`` through hoplite. Returns ``(True, value)``;
        ``(False, GONE)`` when the key is in memory nowhere (lost or being
        recomputed: Dask must locate it again); or ``(False, None)`` when the
        caller should use Dask's own path (the key is small, unknown to the
        directory, or no sender could finish the stream)."""
        while key in self.fetching:  # another local caller is fetching it
            logger.debug("%r: waiting for the fetch already running here", key)
            await asyncio.shield(self.fetching[key])  # our cancellation is not theirs
        buf = self.ctx.store.get(key)
        if buf is not None and buf.state is BufferState.COMPLETE:
            self.ctx.count("local-hits")
            self.senders[key] = self.ctx.address
            return True, await self.ctx.deserialize(buf)

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.fetching[key] = done
        try:
            return await self._fetch(key)
        except asyncio.CancelledError:
            # The task fetching it was cancelled (e.g. a collective whose key
            # was cancelled): no receiver waits for an empty buffer.
            buf = self.ctx.store.get(key)
            if buf is not None and buf.state is not BufferState.COMPLETE:
                self._give_up(key, buf)
            raise
        finally:
            del self.fetching[key]
            done.set_result(None)

    async def _fetch(self, key: Key) -> tuple[bool, Any]:
        """Stream ``key`` into this worker's buffer, resuming with another
        sender after a failure, up to ``hoplite.resume-attempts`` times."""
        buf = self.ctx.store.announce(key)  # may be a partial copy left by an earlier attempt
        excluded: list[str] = []
        gone = busy = False
        reason = ""
        start = dask_time()
        for _attempt in range(self.ctx.config.max_resumes + 1):
            t_request = time.time()
            reply = await self._ask_directory(key, buf, excluded)
            if reply is None:
                reason = "the directory could not be asked"
                break
            if reply.get("status") == "split":
                return await self._fetch_ranges(key, buf, reply, start, t_request)
            if reply.get("status") != "assign":
                reason = f"the directory answered {reply.get('status')!r}"
                gone = bool(reply.get("gone"))
                self.holders[key] = list(reply.get("holders") or ())
                break
            sender, tid = reply["sender"], reply["transfer_id"]
            buf.resume()  # a copy kept for a resume serves its readers again
            if buf.progress:
                self.ctx.count("bytes-resumed", buf.progress)  # not fetched again
            if await self._share(buf, reply, sender, tid):
                value = await self.ctx.deserialize(buf)
                self._received(buf, value, [*excluded, sender], start, t_request)
                return True, value
            nbytes = int(reply.get("nbytes") or 0)
            outcome = await self._stream_from(buf, sender, tid, nbytes, fitted=reply.get("block"))
            if outcome is _RESTART:
                # Another object than the bytes we hold: start over, from byte 0.
                self.ctx.event("restarts", key=str(key), sender=sender)
                buf.fail(LayoutChanged(f"{key!r} changed; restarting from byte 0"))
                self.ctx.store.discard_if(key, buf)
                buf = self.ctx.store.announce(key)
                continue
            if outcome is _BUSY and not buf.progress:
                # Dask's limit on the sender's transfers out, and nothing to
                # resume: Dask's path, which backs off and tries the other
                # holders as Dask does.
                busy = True
                break
            if outcome is _REROUTED or outcome is _MOVED:
                if outcome is _REROUTED:
                    excluded.append(sender)
                self.ctx.event(
                    "reroutes",
                    key=str(key),
                    byte=buf.progress,
                    sender=sender,
                    lagging=outcome is _MOVED,
                )
                continue
            if outcome is _FAILED or outcome is _BUSY:
                excluded.append(sender)
                if buf.progress:
                    self.ctx.event("resumes", key=str(key), byte=buf.progress, failed=sender)
                continue
            self._received(buf, outcome, [*excluded, sender], start, t_request)
            return True, outcome
        if not busy and (reply is None or reply.get("status") != "small"):
            reason = reason or f"no sender finished the stream (tried {', '.join(excluded)})"
            self.ctx.event("fallbacks", key=str(key), reason=reason, byte=buf.progress)
        self._give_up(key, buf)
        return False, GONE if gone else None

    async def _share(self, buf: ObjectBuffer, reply: dict[str, Any], sender: str, tid: int) -> bool:
        """One copy per host, where the directory says this host runs more
        than one worker: map the region of ``sender``, a worker of this host,
        and return True; else (no region there, another host) receive into a
        region of this worker's own, and return False."""
        sharing = self.ctx.sharing
        if sharing is None or int(reply.get("host_workers") or 1) < 2:
            return False
        if buf.layout is None and host_of(sender) == host_of(self.ctx.address):
            t0 = time.monotonic()
            try:
                ok = await sharing.take(buf, sender, self.ctx.config.stall_timeout)
            except BaseException:  # cancelled: the transfer is over
                self._finished(tid, buf.key, False, 0, time.monotonic() - t0)
                raise
            if ok:  # no bytes streamed, and none to count in the network model
                self._finished(tid, buf.key, True, 0, time.monotonic() - t0)
                self.ctx.count("keys-mapped")
                return True
        sharing.receive_into_region(buf)
        return False

    async def _fetch_ranges(
        self, key: Key, buf: ObjectBuffer, reply: dict[str, Any], start: float, t_request: float
    ) -> tuple[bool, Any]:
        """Stream ``key`` into ``buf`` in the byte ranges the directory split
        it into, all at once, each from its own sender and resumed on its
        own; Dask's own path takes over if a range cannot be had."""
        parts, nbytes = int(reply["parts"]), int(reply.get("nbytes") or 0)
        if buf.parts not in (1, parts):  # left by a fetch of an earlier split: start over
            buf.fail(LayoutChanged(f"{key!r} is split into {parts} ranges now"))
            self.ctx.store.discard_if(key, buf)
            buf = self.ctx.store.announce(key)
        buf.split(parts)
        self.ctx.count("keys-received-in-ranges")
        outcomes = await asyncio.gather(
            *(self._fetch_range(buf, j, parts, nbytes) for j in range(parts))
        )
        senders = [o for o in outcomes if isinstance(o, str)]
        if len(senders) == parts and buf.state is BufferState.COMPLETE:
            value = await self.ctx.deserialize(buf)
            self._received(buf, value, senders, start, t_request)
            return True, value
        failed = next(o for o in outcomes if not isinstance(o, str))
        self.ctx.event("fallbacks", key=str(key), reason=failed[1], byte=buf.progress)
        if failed[0] is _RESTART:
            buf.fail(LayoutChanged(f"{key!r} changed while it was received in ranges"))
            self.ctx.store.discard_if(key, buf)
        else:
            self._give_up(key, buf)
        return False, GONE if failed[0] is GONE else None

    def _received(
        self, buf: ObjectBuffer, value: Any, senders: list[str], start: float, t_request: float
    ) -> None:
        """``buf``'s key arrived whole (``value``) from ``senders`` (those it
        gave up on first, or one per range): in Dask's transfer log (from the
        last of them), the worker's counts and its recent transfers."""
        key, sender = buf.key, senders[-1]
        if self.ctx.accounting:
            accounting.received(self.ctx.worker, key, sender, start, dask_time(), buf.nbytes, value)
        self.senders[key] = sender
        self.ctx.count("keys-received")
        self.ctx.recent.append(
            {
                "key": key,
                "sender": sender,
                "nbytes": buf.nbytes,
                "requested": t_request,
                "done": time.time(),
                "senders": senders,
            }
        )

    async def _fetch_range(
        self, buf: ObjectBuffer, j: int, parts: int, nbytes: int
    ) -> str | tuple[object, str]:
        """Range ``j`` of ``parts`` of ``buf``'s key: the sender that
        finished it, or (why not: ``GONE``, ``_RESTART`` or None, a reason)."""
        key = buf.key
        excluded: list[str] = []
        for _attempt in range(self.ctx.config.max_resumes + 1):
            reply = await self._ask_directory(key, buf, excluded, part=[j, parts])
            if reply is None:
                return None, f"range {j}: the directory could not be asked"
            if reply.get("status") != "assign":
                self.holders[key] = list(reply.get("holders") or ())
                reason = f"range {j}: the directory answered {reply.get('status')!r}"
                return (GONE if reply.get("gone") else None), reason
            sender, tid = reply["sender"], reply["transfer_id"]
            buf.resume()
            if excluded and buf.layout is not None:
                lo = range_bounds(buf.nbytes, j, parts)[0]
                if buf.available(lo) > lo:  # not fetched again
                    self.ctx.count("bytes-resumed", buf.available(lo) - lo)
            outcome = await self._stream_from(
                buf, sender, tid, nbytes, part=(j, parts), fitted=reply.get("block")
            )
            if outcome is _RESTART:
                return _RESTART, f"range {j}: {key!r} changed"
            if outcome is _BUSY:  # another holder for this range
                excluded.append(sender)
                continue
            if outcome is _FAILED or outcome is _REROUTED or outcome is _MOVED:
                excluded.append(sender)  # not judged: ranges report no progress
                self.ctx.event("resumes", key=str(key), byte=buf.progress, failed=sender)
                continue
            return str(sender)
        return None, f"range {j}: no sender finished it (tried {', '.join(excluded)})"

    async def _ask_directory(
        self,
        key: Key,
        buf: ObjectBuffer,
        excluded: list[str],
        part: list[int] | None = None,
    ) -> dict[str, Any] | None:
        """The directory's answer for ``key`` (None: it cannot be asked), or
        for its byte range ``part`` (``[j, k]``)."""
        w = self.ctx.worker
        t0 = time.monotonic()
        timelines = self.ctx.timelines
        if timelines is not None:
            timelines.record(key, "asked", part=part, exclude=list(excluded))
        try:
            reply: dict[str, Any] = await w.scheduler.hoplite_request(
                key=key, receiver=w.address, protocol=PROTOCOL_VERSION, exclude=excluded, part=part
            )
        except Exception as e:
            logger.warning("hoplite directory unreachable for %r (%s); using Dask's path", key, e)
            return None
        if timelines is not None:
            timelines.record(
                key, "answered", part=part, status=reply.get("status"), sender=reply.get("sender")
            )
        logger.debug(
            "%r: directory answered %s after %.3fs (progress %d)",
            key,
            {k: v for k, v in reply.items() if k != "holders"},
            time.monotonic() - t0,
            buf.progress,
        )
        if reply.get("status") == "error":
            logger.warning("hoplite directory refused %r: %s", key, reply.get("message"))
        return reply

    def _give_up(self, key: Key, buf: ObjectBuffer) -> None:
        """Dask's own path takes over. A partial copy stays in the store (still
        serving our own receivers as it is) so that a later fetch resumes it,
        e.g. once the object has been recomputed; it goes when Dask releases
        the key here or the key lands in memory."""
        if not buf.progress:
            self.ctx.store.discard_if(key, buf)
            if buf.state is not BufferState.COMPLETE:
                buf.fail(TransferFailed(f"no hoplite sender for {key!r}"))

    async def _stream_from(
        self,
        buf: ObjectBuffer,
        sender: str,
        tid: int,
        nbytes: int,
        part: tuple[int, int] | None = None,
        fitted: object = None,
    ) -> Any:
        """One stream into ``buf`` from ``sender``, from the byte it reached
        (of byte range ``part``, if given), read in blocks of ``fitted`` bytes
        (the directory's fit to the chain; None: this worker's setting).
        Returns the deserialised object (``_RANGE_DONE`` for a range), or
        ``_FAILED`` / ``_RESTART``."""
        ctx, w, key = self.ctx, self.ctx.worker, buf.key
        stall = ctx.config.stall_timeout
        ok = False
        n = 0
        t0 = time.monotonic()
        try:
            with (
                ctx.receiving(key, sender, buf, "object"),
                context_meter.meter("network", func=dask_time),
                _sampled(ctx.timelines, key, buf, sender, part),
            ):
                async with pooled_comm(w.rpc, sender, stall) as comm:
                    offset = 0
                    if buf.layout is not None:
                        lo = 0 if part is None else range_bounds(buf.nbytes, *part)[0]
                        offset = buf.available(lo)
                    parts = 1 if part is None else part[1]
                    block = ctx.config.block_size_for(nbytes // parts, fitted=fitted)
                    raw = raw_stream(comm) is not None
                    req = StreamRequest(key, offset, block, tid, raw=raw, who=w.address, part=part)
                    self._comms[tid] = comm
                    with self._reporting(buf, tid, part):
                        n = await receive_stream(comm, buf, req, stall_timeout=stall)
            ok = True
            ctx.count("bytes-received", n)
            if part is not None:
                return _RANGE_DONE
            return await ctx.deserialize(buf)
        except LayoutChanged as e:
            logger.info("%s", e)
            return _RESTART
        except SenderBusy:
            logger.debug("%s is busy for %r", sender, key)
            ctx.count("senders-busy")
            return _BUSY
        except Exception as e:
            if tid in self._rerouted:
                logger.info("%r: dropped the stream from %s at byte %d", key, sender, buf.progress)
                forget_frames(e)
                return self._rerouted[tid]
            logger.warning(
                "hoplite stream of %r from %s failed at byte %d (%s: %s); resuming elsewhere",
                key,
                sender,
                buf.progress,
                type(e).__name__,
                e,
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            ctx.count("streams-failed")
            forget_frames(e)
            return _FAILED
        finally:
            self._comms.pop(tid, None)
            self._rerouted.pop(tid, None)
            self._finished(tid, key, ok, n, time.monotonic() - t0, 1 if part is None else part[1])

    def _finished(
        self, tid: int, key: Key, ok: bool, nbytes: int, seconds: float, parts: int = 1
    ) -> None:
        """Tell the directory that transfer ``tid`` ended, with what it moved
        (for the network model: ``parts`` ranges shared the NIC)."""
        self.ctx.send(
            {
                "op": "hoplite-finished",
                "transfer_id": tid,
                "ok": ok,
                "key": key,
                "nbytes": nbytes,
                "seconds": seconds,
                "latency": self.ctx.worker.latency,
                "parts": parts,
            }
        )

    @contextlib.contextmanager
    def _reporting(
        self, buf: ObjectBuffer, tid: int, part: tuple[int, int] | None
    ) -> Iterator[None]:
        """While the body runs, tell the directory every
        ``hoplite.broadcast.slow-relay.report-interval`` the byte the stream
        of transfer ``tid`` into ``buf`` reached, for the rates it judges relays by: none when that is off,
        nor for a byte range (ranges travel down trees of their own)."""
        ctx = self.ctx
        if ctx.config.slow_relay_ratio <= 0 or part is not None:
            yield
            return
        interval = ctx.config.slow_relay_interval

        async def report() -> None:
            while True:
                await asyncio.sleep(interval)
                # This host's clock: the directory takes rates from it, not
                # from when the reports reach it through two busy event loops.
                ctx.send(
                    {
                        "op": PROGRESS_OP,
                        "transfer_id": tid,
                        "position": buf.progress,
                        "at": time.monotonic(),
                    }
                )

        task = asyncio.ensure_future(report())
        try:
            yield
        finally:
            task.cancel()

    async def fetch_parts(self, keys: list[Key], who_has: dict[Key, list[str]]) -> list[Any]:
        """The values of ``keys`` here: from memory, through hoplite, or from a
        holder by Dask's own ``get_data``. Raises :class:`distributed.Reschedule`
        when a key cannot be had from any holder (the scheduler then recomputes
        it from its lineage and runs the task again).

        A key fetched through hoplite that Dask does not track on this worker
        (a task's own fetch, not a dependency) leaves no copy in the store:
        no Dask transition would ever release it here."""
        w = self.ctx.worker
        out: dict[Key, Any] = {k: w.data[k] for k in keys if k in w.data}
        for key in keys:
            if key in out:
                continue
            try:
                ok, value = await self.fetch(key)
            finally:  # returned, failed or cancelled: an untracked copy goes
                self.senders.pop(key, None)
                if key not in w.state.tasks and key in self.ctx.store:
                    self.drop_untracked(key)
            out[key] = value if ok else await get_data_or_reschedule(w, key, who_has[key])
        return [out[k] for k in keys]


@contextlib.contextmanager
def _sampled(
    timelines: Timelines | None,
    key: Key,
    buf: ObjectBuffer,
    sender: str,
    part: tuple[int, int] | None,
) -> Iterator[None]:
    """With timelines on: one stream of ``key`` from ``sender`` in ``key``'s
    timeline, its start, its end, and the bytes in hand meanwhile."""
    if timelines is None:
        yield
        return
    pool = buf.pool

    def mapped() -> int:  # regions the pool mapped fresh so far (0: no pool)
        return int(getattr(pool, "allocated", 0))

    timelines.record(key, "stream", sender=sender, part=part, at=buf.progress, mapped=mapped())
    ok = False
    try:
        with timelines.sampling(key, lambda: buf.progress):
            yield
        ok = True
    finally:
        timelines.record(
            key, "streamed", sender=sender, part=part, ok=ok, at=buf.progress, mapped=mapped()
        )


async def get_data_or_reschedule(w: Worker, key: Key, holders: Iterable[str]) -> Any:
    """The value of ``key`` from the first of ``holders`` that gives it, by
    Dask's own ``get_data``. Raises :class:`distributed.Reschedule` when none
    does: the scheduler recomputes the key from its lineage and runs the
    calling task again."""
    for holder in holders:
        with contextlib.suppress(OSError, CommClosedError, asyncio.TimeoutError):
            resp = await get_data_from_worker(w.rpc, [key], holder, who=w.address)
            if resp["status"] == "OK" and key in resp["data"]:
                return resp["data"][key]
    raise Reschedule()
