"""The worker part: a block store, the peer handler that streams a key out of
it, and the takeover of Dask's fetch path for large keys.

Installed by the scheduler part on every worker (also on workers that join
later or restart). It replaces, on the worker *instance*:

* ``worker.gather_dep``: keys of at least ``hoplite.min-bytes`` are fetched as
  block streams from the sender the directory assigns; the rest, and anything
  hoplite cannot fetch, go to Dask's original method. The returned event obeys
  the rules of Dask's state machine (same ``worker`` and ``total_nbytes`` as the
  instruction, keys left out of ``data`` mean "the peer lacks it", no exception
  escapes).
* ``worker.handlers["gather"]``: the endpoint of ``client.replicate`` and
  ``client.scatter(..., broadcast=True)``, likewise.

and adds the ``hoplite_stream`` handler. ``teardown`` restores all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import uuid
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
)
from time import time
from typing import Any

import numpy as np
from dask._task_spec import Task
from distributed import Reschedule, WorkerPlugin, get_worker, secede
from distributed.comm.core import Comm, CommClosedError
from distributed.core import Status
from distributed.protocol import deserialize, serialize, to_serialize
from distributed.utils import offload, sync
from distributed.worker import WORKER_ANY_RUNNING, Worker, get_data_from_worker
from distributed.worker_state_machine import (
    ComputeTaskEvent,
    GatherDepSuccessEvent,
    SecedeEvent,
    StateMachineEvent,
)
from tornado.ioloop import PeriodicCallback

from dask_hoplite._version import __version__
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.graph_reduce import GraphReduce
from dask_hoplite.core.planner import (
    ReduceTree,
    colocated_order,
    max_chain_length,
    plan_reduce_tree,
)
from dask_hoplite.core.protocol import (
    PROTOCOL_VERSION,
    STREAM_OP,
    StreamRequest,
    error_reply,
)
from dask_hoplite.core.reduce_ops import resolve_op
from dask_hoplite.core.reduce_spec import (
    ReduceSpec,
    check_input,
    is_partial_key,
    reduce_values,
    select_field,
)
from dask_hoplite.core.store import BlockStore, BufferPool, BufferState, ObjectBuffer
from dask_hoplite.core.tree_repair import TreeRepair
from dask_hoplite.errors import (
    LayoutChanged,
    NodeFailed,
    ProtocolError,
    ReduceInputError,
    VersionMismatch,
)
from dask_hoplite.reduction import run_node
from dask_hoplite.scheduler_queries import network_estimate
from dask_hoplite.streams import (
    connect,
    drop,
    raw_stream,
    receive_stream,
    send_stream,
    wait_progress,
)

logger = logging.getLogger(__name__)

from dask.typing import Key  # noqa: E402

PLUGIN_NAME = "hoplite-worker"
#: ``fetch`` result: the key is in memory nowhere (lost, being recomputed).
GONE = object()
_FAILED = object()  # a stream ended without the whole object: resume elsewhere
_RESTART = object()  # the sender holds another object: start over
_TRIM_CALLBACK = "hoplite-pool-trim"


@dataclasses.dataclass
class _RootRepair:
    """What a root's worker keeps to replace a node of a running tree."""

    repair: TreeRepair
    #: The task running each node now (its call to the node's worker).
    current: dict[int, asyncio.Task[Any]]
    #: Replacement nodes started, for the root's loop to wait on.
    joined: asyncio.Queue[tuple[int, asyncio.Task[Any]]]


class HopliteWorker(WorkerPlugin):
    """Worker half of dask-hoplite. Users do not create this themselves: the
    scheduler plugin :class:`dask_hoplite.Hoplite` registers it.

    Parameters
    ----------
    scheduler_version:
        The dask-hoplite version of the scheduler that sent this plugin; a
        worker with another version refuses to start the plugin.
    """

    name = PLUGIN_NAME

    def __init__(self, scheduler_version: str = __version__) -> None:
        self.scheduler_version = scheduler_version
        self.worker: Worker | None = None
        self.store = BlockStore()
        self.stats: dict[str, int] = {}
        self._orig_gather_dep: Any = None
        self._orig_gather: Any = None
        self._orig_handle_stimulus: Any = None
        self._fetching: dict[Key, asyncio.Future[None]] = {}
        #: Partial copies of released keys kept for a resume, with their expiry.
        self._orphans: dict[Key, tuple[ObjectBuffer, asyncio.TimerHandle]] = {}
        #: Holders of keys hoplite gave up on, as the scheduler saw them then.
        self._holders: dict[Key, list[str]] = {}
        #: The latest transfers into this worker: key, sender, bytes, and wall
        #: times of the directory request, the assignment and the last byte.
        self.recent: deque[dict[str, Any]] = deque(maxlen=100)
        # Reduce trees: partial results announced / fully sent, running nodes.
        self._announced: dict[Key, asyncio.Future[None]] = {}
        self._sent: dict[Key, asyncio.Future[None]] = {}
        self._reductions: dict[str, set[asyncio.Task[Any]]] = {}
        self._aborted: deque[str] = deque(maxlen=1000)  # an abort may beat its node
        #: Reductions whose root runs here (their nodes ask while they wait).
        self._roots: set[str] = set()
        #: The repair state of the reductions whose root runs here.
        self._repairs: dict[str, _RootRepair] = {}
        self._background: set[asyncio.Future[Any]] = set()  # fire-and-forget calls
        #: ``hoplite_result`` requests waiting for a task of this worker to finish.
        self._result_waiters: dict[Key, list[asyncio.Future[None]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"scheduler_version": self.scheduler_version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["scheduler_version"])  # type: ignore[misc]

    # ------------------------------------------------------------ lifecycle

    def setup(self, worker: Worker) -> None:
        if self.scheduler_version != __version__:
            raise VersionMismatch(
                f"dask-hoplite {__version__} on worker {worker.address} does not match "
                f"dask-hoplite {self.scheduler_version} on the scheduler; install the same "
                "version everywhere. This worker keeps using Dask's own transfers."
            )
        self.config = HopliteConfig.from_dask_config()
        self.store = BlockStore(BufferPool(self.config.buffer_pool_bytes))
        self.worker = worker
        self._orig_gather_dep = worker.gather_dep
        worker.gather_dep = self.gather_dep  # type: ignore[method-assign]
        self._orig_gather = worker.handlers["gather"]
        worker.handlers["gather"] = self.handle_gather
        worker.handlers[STREAM_OP] = self.handle_stream
        worker.handlers["hoplite_worker_info"] = self.info
        worker.handlers["hoplite_reduce_node"] = self.handle_reduce_node
        worker.handlers["hoplite_reduce_abort"] = self.handle_reduce_abort
        worker.handlers["hoplite_reduce_running"] = self.handle_reduce_running
        worker.handlers["hoplite_result"] = self.handle_result
        worker.handlers["hoplite_reduce_replace"] = self.handle_reduce_replace
        self._orig_handle_stimulus = worker.handle_stimulus
        worker.handle_stimulus = self.handle_stimulus  # type: ignore[method-assign]
        trim = PeriodicCallback(self._trim_pool, 1000 * min(1.0, self.config.buffer_pool_idle))
        worker.periodic_callbacks[_TRIM_CALLBACK] = trim
        trim.start()
        logger.debug("hoplite worker part installed on %s", worker.address)

    def teardown(self, worker: Worker) -> None:
        if self.worker is None:
            return
        if worker.__dict__.get("gather_dep") == self.gather_dep:
            del worker.gather_dep
        if worker.handlers.get("gather") == self.handle_gather:
            worker.handlers["gather"] = self._orig_gather
        if worker.__dict__.get("handle_stimulus") == self.handle_stimulus:
            del worker.handle_stimulus
        if worker.handlers.get(STREAM_OP) == self.handle_stream:
            del worker.handlers[STREAM_OP]
        for name, h in [
            ("hoplite_worker_info", self.info),
            ("hoplite_reduce_node", self.handle_reduce_node),
            ("hoplite_reduce_abort", self.handle_reduce_abort),
            ("hoplite_reduce_running", self.handle_reduce_running),
            ("hoplite_result", self.handle_result),
            ("hoplite_reduce_replace", self.handle_reduce_replace),
        ]:
            if worker.handlers.get(name) == h:
                del worker.handlers[name]
        for tasks in self._reductions.values():
            for t in tasks:
                t.cancel()
        for _, handle in self._orphans.values():
            handle.cancel()
        self._orphans.clear()
        trim = worker.periodic_callbacks.pop(_TRIM_CALLBACK, None)
        if trim is not None:
            trim.stop()
        for key in list(self.store.buffers):
            self.store.release(key)
        self.store.pool.clear()
        self.worker = None

    def transition(self, key: Key, start: str, finish: str, **kwargs: Any) -> None:
        """Drop our buffer when Dask lets go of the key on this worker; wake
        the ``hoplite_result`` requests for a task that finished here."""
        if finish in ("memory", "error", "released", "forgotten"):
            for fut in self._result_waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)
        if finish in ("released", "forgotten") and key in self.store:
            if key in self._fetching:
                # Our stream is still running (Dask cancelled the fetch, e.g.
                # because the key was lost and is being recomputed): let it
                # finish or resume; Dask releases the key again afterwards.
                return
            buf = self.store.get(key)
            if (
                buf is not None
                and buf.state is BufferState.RECEIVING
                and buf.progress > 0
                and self.config.resume_window > 0
            ):
                self._keep_for_resume(key, buf)
            else:
                self._forget_orphan(key)
                self.store.release(key)
            self._send({"op": "hoplite-released", "key": key})
        elif finish == "memory":
            self._forget_orphan(key)
            buf = self.store.get(key)
            if buf is None or buf.state is BufferState.COMPLETE:
                return
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            if (
                loop is not None
                and buf.state is BufferState.RECEIVING
                and key not in self._fetching
                and self.worker is not None
                and key in self.worker.data
            ):
                # The key was computed here (a lost key recomputed) or came by
                # Dask's own path while a partial copy of ours waited to be
                # resumed: complete that copy from the value, so that the
                # receivers streaming from it carry on.
                task = loop.create_task(self._adopt_local(key, buf))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                self._drop_copy(key)

    async def _adopt_local(self, key: Key, buf: ObjectBuffer) -> None:
        """Complete the partial copy ``buf`` of ``key`` with the value in this
        worker's memory; if the value is another object (a non-deterministic
        task recomputed), drop the copy: its readers restart elsewhere."""
        w = self.worker
        assert w is not None
        try:
            if key not in w.data:
                raise KeyError(f"{key!r} left memory before it was adopted")
            header, frames = await self._serialize(w.data[key])
            if self.store.get(key) is not buf or buf.state is not BufferState.RECEIVING:
                return  # released or completed meanwhile
            buf.adopt(ObjectBuffer.from_frames(key, header, frames))
            self._count("partial-copies-adopted")
            logger.debug("%r: partial copy completed from the value computed here", key)
        except Exception as e:
            logger.info("%r: partial copy not completed from the local value (%s)", key, e)
            if self.store.get(key) is buf:
                self._drop_copy(key)

    def _drop_copy(self, key: Key) -> None:
        """Drop our copy of ``key`` (its readers fail over) and tell the directory."""
        self.store.release(key)
        self._send({"op": "hoplite-released", "key": key})

    def _keep_for_resume(self, key: Key, buf: ObjectBuffer) -> None:
        """Keep the partial copy ``buf`` of a key Dask released here for
        ``hoplite.resume-window``: the key was typically lost and is being
        recomputed, and the next fetch of it resumes this buffer. Meanwhile
        it serves nobody: the receivers streaming from it give up at once
        (and keep their own bytes likewise), and the directory no longer
        lists it."""
        w = self.worker
        buf.interrupt(KeyError(f"{key!r} was released on {w.address if w else 'this worker'}"))
        kept = self._orphans.get(key)
        if kept is not None:
            if kept[0] is buf:
                return  # already timed
            self._forget_orphan(key)

        def expire() -> None:
            if self._orphans.get(key, (None,))[0] is buf:
                del self._orphans[key]
            if (
                self.store.get(key) is buf
                and key not in self._fetching
                and buf.state is not BufferState.COMPLETE
            ):
                logger.debug("dropping the partial copy of %r kept for a resume", key)
                self.store.release(key)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on the worker's event loop: nothing to time it with
            self.store.release(key)
            return
        self._orphans[key] = (buf, loop.call_later(self.config.resume_window, expire))
        self._count("partial-copies-kept")

    def _forget_orphan(self, key: Key) -> None:
        """Stop timing the kept copy of ``key`` (the store no longer holds it)."""
        kept = self._orphans.pop(key, None)
        if kept is not None:
            kept[1].cancel()

    # ------------------------------------------------------------- helpers

    def _trim_pool(self) -> None:
        freed = self.store.pool.trim(self.config.buffer_pool_idle)
        if freed:
            logger.debug("returned %d idle pooled bytes to the OS", freed)

    def _send(self, msg: dict[str, Any]) -> None:
        w = self.worker
        bs = w.batched_stream if w is not None else None
        if w is not None and bs is not None and bs.comm is not None and not bs.comm.closed():
            w.batched_send(msg)

    def _count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    def _is_large(self, key: Key) -> bool:
        assert self.worker is not None
        ts = self.worker.state.tasks.get(key)
        return ts is not None and (ts.nbytes or 0) >= self.config.min_bytes

    async def _serialize(self, value: Any) -> tuple[dict[str, Any], list[Any]]:
        """``value`` as hoplite serves it: header and frames (zero-copy for
        numpy arrays), serialised off the event loop."""
        return await offload(serialize, value, serializers=("dask", "pickle"), on_error="raise")

    async def _deserialize(self, buf: ObjectBuffer) -> Any:
        assert buf.layout is not None
        # Dask's deserialize mutates headers (it pops collection keys); the
        # layout keeps serving other receivers, so give it a copy.
        header = copy.deepcopy(buf.layout.header)
        return await offload(deserialize, header, buf.frames())

    # ---------------------------------------------------------- receiving

    async def fetch(self, key: Key) -> tuple[bool, Any]:
        """Fetch ``key`` through hoplite. Returns ``(True, value)``;
        ``(False, GONE)`` when the key is in memory nowhere (lost or being
        recomputed: Dask must locate it again); or ``(False, None)`` when the
        caller should use Dask's own path (the key is small, unknown to the
        directory, or no sender could finish the stream)."""
        assert self.worker is not None
        while key in self._fetching:  # another local caller is fetching it
            logger.debug("%r: waiting for the fetch already running here", key)
            await self._fetching[key]
        buf = self.store.get(key)
        if buf is not None and buf.state is BufferState.COMPLETE:
            self._count("local-hits")
            return True, await self._deserialize(buf)

        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fetching[key] = done
        try:
            return await self._fetch(key)
        finally:
            del self._fetching[key]
            done.set_result(None)

    async def _fetch(self, key: Key) -> tuple[bool, Any]:
        """Stream ``key`` into this worker's buffer; when the sender dies or
        stalls, resume from the byte reached with another sender the directory
        assigns (never one downstream of us), restarting from byte 0 only if
        the new sender's copy is another object (recomputed differently)."""
        w = self.worker
        assert w is not None
        buf = self.store.announce(key)  # may be a partial copy left by an earlier attempt
        excluded: list[str] = []
        gone = False
        for _attempt in range(self.config.max_resumes + 1):
            t_request = time()
            try:
                reply = await w.scheduler.hoplite_request(
                    key=key, receiver=w.address, protocol=PROTOCOL_VERSION, exclude=excluded
                )
            except Exception as e:
                logger.warning(
                    "hoplite directory unreachable for %r (%s); using Dask's path", key, e
                )
                break
            logger.debug(
                "%r: directory answered %s after %.3fs (progress %d)",
                key,
                {k: v for k, v in reply.items() if k != "holders"},
                time() - t_request,
                buf.progress,
            )
            if reply.get("status") != "assign":
                if reply.get("status") == "error":
                    logger.warning("hoplite directory refused %r: %s", key, reply.get("message"))
                gone = bool(reply.get("gone"))
                self._holders[key] = list(reply.get("holders") or ())
                break
            sender, tid = reply["sender"], reply["transfer_id"]
            buf.resume()  # a copy kept for a resume serves its readers again
            if buf.progress:
                self._count("bytes-resumed", buf.progress)  # not fetched again
            outcome = await self._stream_from(buf, sender, tid, int(reply.get("nbytes") or 0))
            if outcome is _RESTART:
                # Another object than the bytes we hold: start over, from byte 0.
                self._count("restarts")
                buf.fail(LayoutChanged(f"{key!r} changed; restarting from byte 0"))
                self.store.discard_if(key, buf)
                buf = self.store.announce(key)
                continue
            if outcome is _FAILED:
                excluded.append(sender)
                if buf.progress:
                    self._count("resumes")
                continue
            self.recent.append(
                {
                    "key": key,
                    "sender": sender,
                    "nbytes": buf.nbytes,
                    "requested": t_request,
                    "done": time(),
                    "senders": [*excluded, sender],
                }
            )
            return True, outcome
        # Give up for now: Dask's own path takes over. A partial copy stays in
        # the store (still serving our own receivers as it is) so that a later
        # fetch resumes it, e.g. once the object has been recomputed; it goes
        # when Dask releases the key here or the key lands in memory.
        if not buf.progress:
            self.store.discard_if(key, buf)
            if buf.state is not BufferState.COMPLETE:
                buf.fail(RuntimeError(f"no hoplite sender for {key!r}"))
        return False, GONE if gone else None

    async def _stream_from(self, buf: ObjectBuffer, sender: str, tid: int, nbytes: int) -> Any:
        """One stream into ``buf`` from ``sender``, from the byte it reached.
        Returns the deserialised object, or ``_FAILED`` / ``_RESTART``."""
        w = self.worker
        assert w is not None
        key = buf.key
        block = self.config.block_size_for(nbytes)
        ok = False
        n = 0
        comm: Comm | None = None
        t0 = time()
        try:
            comm = await connect(w.rpc, sender, self.config.stall_timeout)
            offset = buf.progress if buf.layout is not None else 0
            req = StreamRequest(key, offset, block, tid, raw=raw_stream(comm) is not None)
            n = await receive_stream(comm, buf, req, stall_timeout=self.config.stall_timeout)
            w.rpc.reuse(sender, comm)
            comm = None
            value = await self._deserialize(buf)
            ok = True
            self._count("bytes-received", n)
            self._count("keys-received")
            return value
        except LayoutChanged as e:
            logger.info("%s", e)
            return _RESTART
        except Exception as e:
            logger.warning(
                "hoplite stream of %r from %s failed at byte %d (%s: %s); resuming elsewhere",
                key,
                sender,
                buf.progress,
                type(e).__name__,
                e,
                exc_info=logger.isEnabledFor(logging.DEBUG),
            )
            self._count("streams-failed")
            return _FAILED
        finally:
            if comm is not None:
                drop(w.rpc, sender, comm)
            self._send(
                {
                    "op": "hoplite-finished",
                    "transfer_id": tid,
                    "ok": ok,
                    "key": key,
                    "nbytes": n,
                    "seconds": time() - t0,
                    "latency": w.latency,
                }
            )

    async def gather_dep(
        self,
        worker: str,
        to_gather: Collection[Key],
        total_nbytes: int,
        *,
        stimulus_id: str,
    ) -> StateMachineEvent:
        """Dask's ``Worker.gather_dep`` with large keys fetched through hoplite."""
        w = self.worker
        orig = self._orig_gather_dep
        large = [k for k in to_gather if self._is_large(k)] if w is not None else []
        gone: set[Key] = set()
        if not large or w is None or w.status not in WORKER_ANY_RUNNING:
            return await orig(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
        logger.debug(
            "gather_dep from %s: %d key(s), %d through hoplite", worker, len(to_gather), len(large)
        )
        results = await asyncio.gather(*(self.fetch(k) for k in large), return_exceptions=True)
        data: dict[Key, Any] = {}
        for key, res in zip(large, results, strict=True):
            if isinstance(res, BaseException):
                logger.error("hoplite fetch of %r raised", key, exc_info=res)
            elif res[0]:
                data[key] = res[1]
            elif res[1] is GONE or worker not in self._holders.get(key, [worker]):
                gone.add(key)
            self._holders.pop(key, None)
        # Keys no longer in memory anywhere, or no longer on the peer Dask
        # picked: Dask's holder is stale (dead, or the key is being
        # recomputed). Leaving them out of ``data`` tells the state machine
        # this peer lacks them, so it asks the scheduler where they are now
        # instead of trying a dead peer until its connect timeout.
        rest = [k for k in to_gather if k not in data and k not in gone]
        if not rest:
            w.state.log.append(("receive-dep-hoplite", worker, set(data), stimulus_id, time()))
            return GatherDepSuccessEvent(
                worker=worker,
                total_nbytes=total_nbytes,
                data=data,
                stimulus_id=f"hoplite-gather-dep-success-{time()}",
            )
        ev = await orig(worker, rest, total_nbytes, stimulus_id=stimulus_id)
        if isinstance(ev, GatherDepSuccessEvent):
            ev.data.update(data)
        # Otherwise the keys go back to `fetch`; what hoplite fetched stays in
        # the store as a complete buffer and the retry finds it there.
        return ev

    async def handle_gather(self, who_has: dict[Key, list[str]]) -> dict[str, Any]:
        """The ``gather`` endpoint (``client.replicate``, ``scatter(broadcast=True)``)."""
        w = self.worker
        assert w is not None
        wanted = [k for k in who_has if k not in w.data]
        results = await asyncio.gather(*(self.fetch(k) for k in wanted), return_exceptions=True)
        data = {
            k: r[1]
            for k, r in zip(wanted, results, strict=True)
            if not isinstance(r, BaseException) and r[0]
        }
        if data:
            w.update_data(data=data, stimulus_id=f"hoplite-gather-{time()}")
        rest = {k: v for k, v in who_has.items() if k not in data}
        if not rest:
            return {"status": "OK"}
        return await self._orig_gather(who_has=rest)

    # ------------------------------------------------------------ sending

    async def _source(self, key: Key) -> ObjectBuffer | None:
        """The buffer to serve ``key`` from: a receiving or complete buffer of
        ours, else the object in ``worker.data`` serialised once (zero-copy for
        numpy arrays)."""
        w = self.worker
        assert w is not None
        buf = self.store.get(key)
        if buf is not None and buf.state is not BufferState.FAILED:
            return buf
        if is_partial_key(key):
            if key[1] in self._aborted:  # type: ignore[index,operator]
                return None
            # A reduce node's partial result: its node may not have started yet.
            fut = self._announced.setdefault(key, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.config.stall_timeout)
            except asyncio.TimeoutError:
                return None
            finally:
                if self._announced.get(key) is fut and fut.done():
                    del self._announced[key]
            return self.store.get(key)
        if key not in w.data:
            return None
        header, frames = await self._serialize(w.data[key])
        return self.store.add_source(key, header, frames)

    async def handle_stream(self, comm: Comm, **msg: Any) -> Status:
        """Peer handler: stream a key from a byte offset (protocol.py)."""
        w = self.worker
        assert w is not None
        try:
            req = StreamRequest.parse(msg)
            buf = await self._source(req.key)
            if buf is None:
                raise ProtocolError(f"worker {w.address} holds no copy of key {req.key!r}")
            if buf.layout is None:  # announced, the receiver's own sender not connected yet
                await wait_progress(buf, 0, self.config.stall_timeout)
            assert buf.layout is not None
            if req.offset > buf.layout.nbytes:
                raise ProtocolError(
                    f"offset {req.offset} is past the end of {req.key!r} ({buf.layout.nbytes} bytes)"
                )
        except Exception as e:
            logger.info("refusing hoplite stream to %s: %s", comm.peer_address, e)
            self._count("requests-refused")
            try:
                await comm.write(error_reply(str(e)))
            except (CommClosedError, OSError):
                pass
            return Status.dont_reply
        try:
            n = await send_stream(
                comm,
                buf,
                req,
                window_bytes=self.config.window_bytes,
                stall_timeout=self.config.stall_timeout,
            )
            self._count("bytes-sent", n)
            sent = self._sent.get(req.key)
            if sent is not None and not sent.done() and req.offset + n == buf.nbytes:
                sent.set_result(None)
        except Exception as e:
            logger.info("hoplite stream of %r to %s ended: %s", req.key, comm.peer_address, e)
            self._count("streams-aborted")
            comm.abort()
        return Status.dont_reply

    def info(self) -> dict[str, Any]:
        """Handler ``hoplite_worker_info``: the store's size and counters."""
        return {
            "buffers": len(self.store),
            "nbytes": self.store.nbytes,
            "pool_idle_bytes": self.store.pool.idle_bytes,
            "pool_reused": self.store.pool.reused,
            "stats": dict(self.stats),
            "recent": list(self.recent),
            "version": __version__,
        }

    # ------------------------------------------------- dask.array reductions

    def handle_stimulus(self, *stims: StateMachineEvent) -> None:
        """Dask's ``Worker.handle_stimulus``, with the aggregate tasks of
        dask.array reductions (see :mod:`dask_hoplite.core.graph_reduce`) taken over
        when their inputs are large: the task no longer depends on fetching the
        inputs here; it reduces them where they live."""
        self._orig_handle_stimulus(*(self._take_over_reduce(ev) for ev in stims))

    def _take_over_reduce(self, ev: StateMachineEvent) -> StateMachineEvent:
        w = self.worker
        if not isinstance(ev, ComputeTaskEvent) or w is None:
            return ev
        spec = ev.run_spec
        fn = getattr(spec, "func", None)
        if not isinstance(spec, Task) or not isinstance(fn, GraphReduce):
            return ev
        keys = [a.key for a in spec.args]  # TaskRefs, in the order of the parts
        if (
            len(keys) < 2
            or set(keys) != set(ev.who_has)
            or max(ev.nbytes.values(), default=0) < self.config.min_bytes
            or all(w.address in ev.who_has[k] for k in keys)
        ):
            return ev
        who_has = {k: list(v) for k, v in ev.who_has.items()}
        run = functools.partial(_run_graph_reduce, fn, keys, who_has, dict(ev.nbytes))
        self._count("graph-reductions")
        logger.debug("%r: reducing %d inputs where they live", ev.key, len(keys))
        return dataclasses.replace(ev, who_has={}, nbytes={}, run_spec=Task(ev.key, run))

    async def graph_reduce(
        self, fn: GraphReduce, keys: list[Key], who_has: dict[Key, list[str]], size: int
    ) -> Any:
        """Combine the parts ``keys`` elementwise with a reduce tree rooted
        here; returns the combined part (a dict of arrays for dict parts).
        Raises :class:`ReduceInputError` when the parts do not suit a tree (the
        caller then runs Dask's own aggregate on fetched parts)."""
        w = self.worker
        assert w is not None
        me = w.address
        addresses = [me if me in who_has[k] else sorted(who_has[k])[0] for k in keys]
        local = [i for i, a in enumerate(addresses) if a == me]
        if not local:
            raise ReduceInputError("no input of the reduction is on this worker")
        # A local part at the root's slot: its value is the root's operand.
        plan, order = await self._plan_rooted_at(len(keys), size, local[0], addresses)
        inputs = tuple(keys[i] for i in order)
        first = w.data[inputs[plan.root]]
        fields: tuple[str | None, ...] = fn.fields or (None,)
        operands = []
        for field in fields:
            operand = check_input(select_field(first, field, inputs[plan.root]), inputs[plan.root])
            if not fn.accepts(operand.dtype):
                raise ReduceInputError(f"{fn!r} does not combine {operand.dtype} parts")
            if not fn.parts_fit(operand.shape):
                raise ReduceInputError(
                    f"input {inputs[plan.root]!r} has extent != 1 along the reduced axes"
                )
            operands.append(operand)
        rid = uuid.uuid4().hex
        specs = [
            ReduceSpec(
                rid=f"{rid}-{j}",
                op=fn.op,
                inputs=inputs,
                addresses=tuple(addresses[i] for i in order),
                parent=plan.parent,
                shape=(),
                dtype="",
                block_bytes=self.config.block_bytes,
                field=field,
            )
            for j, field in enumerate(fields)
        ]
        results = await asyncio.gather(
            *(self.run_reduction(v, sp.to_msg()) for v, sp in zip(operands, specs, strict=True))
        )
        return results[0] if fn.fields is None else dict(zip(fn.fields, results, strict=True))

    async def _plan_rooted_at(
        self, n: int, size: int, slot: int, addresses: list[str]
    ) -> tuple[ReduceTree, list[int]]:
        """A tree for ``n`` inputs of ``size`` bytes shaped by the measured
        network, and the order of the inputs (held by ``addresses``) over its
        positions that puts input ``slot`` at the root (the root's operand
        must be local) and the inputs of one worker next to each other."""
        assert self.worker is not None
        net = await network_estimate(self.worker.scheduler)
        plan = plan_reduce_tree(n, max_chain_length(size, net.bandwidth, net.latency))
        return plan, colocated_order(plan.parent, addresses, slot)

    async def fetch_parts(self, keys: list[Key], who_has: dict[Key, list[str]]) -> list[Any]:
        """The values of ``keys``, fetched here (the fallback of
        :meth:`graph_reduce`). Raises :class:`distributed.Reschedule` when a
        part cannot be had from any holder (the scheduler then recomputes it
        from its lineage and runs the task again)."""
        w = self.worker
        assert w is not None
        out: dict[Key, Any] = {k: w.data[k] for k in keys if k in w.data}
        for key in keys:
            if key in out:
                continue
            ok, value = await self.fetch(key)
            if ok:
                out[key] = value
                continue
            for holder in who_has[key]:
                with contextlib.suppress(OSError, CommClosedError, asyncio.TimeoutError):
                    resp = await get_data_from_worker(w.rpc, [key], holder, who=w.address)
                    if resp["status"] == "OK" and key in resp["data"]:
                        out[key] = resp["data"][key]
                        break
            else:
                raise Reschedule()
        return [out[k] for k in keys]

    # ------------------------------------------------------------- reduce

    def announced(self, key: Key) -> None:
        """A reduce node created its partial buffer: wake waiting senders."""
        fut = self._announced.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def run_node_until_sent(
        self, spec: ReduceSpec, slot: int, value: Any, offset: int = 0
    ) -> None:
        """Run one non-root node and hold its partial result until the parent
        has streamed all of it.

        The parent reads its children in lockstep, so it may take this
        node's last byte long after the node finished (a slower sibling, a
        busy host). Only a reduction whose root stopped running it ends the
        wait early: an alive root aborts the whole tree when any node fails,
        so it is asked, once per stall timeout of waiting."""
        key = spec.partial_key(slot)
        root = spec.addresses[spec.root]
        async with self._held_until_sent(key, alive=lambda: self._root_running(root, spec.rid)):
            await run_node(self, spec, slot, value, offset)

    async def _root_running(self, root: str, rid: str) -> bool:
        """Whether worker ``root`` still runs reduction ``rid`` (no answer
        within the stall timeout counts as no)."""
        w = self.worker
        assert w is not None
        try:
            return bool(
                await asyncio.wait_for(
                    w.rpc(root).hoplite_reduce_running(rid=rid), self.config.stall_timeout
                )
            )
        except Exception:
            return False

    def handle_reduce_running(self, rid: str) -> bool:
        """RPC ``hoplite_reduce_running``: whether the root of ``rid`` runs here."""
        return rid in self._roots

    @contextlib.asynccontextmanager
    async def _held_until_sent(
        self,
        key: Key,
        hold: bool = True,
        alive: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[None]:
        """Keep the buffer of ``key`` in the store after the body, until a peer
        has streamed all of it; then release it. Waiting is bounded by the
        stall timeout, or, given ``alive``, lasts while ``alive()`` (asked
        after each stall timeout of waiting) says the reduction still runs."""
        sent = self._sent[key] = asyncio.get_running_loop().create_future()
        try:
            yield
            while hold:
                try:
                    await asyncio.wait_for(asyncio.shield(sent), self.config.stall_timeout)
                    break
                except asyncio.TimeoutError:
                    if alive is None or not await alive():
                        raise asyncio.TimeoutError(
                            f"no peer took all of {key!r} within {self.config.stall_timeout:g}s"
                        ) from None
        finally:
            self._sent.pop(key, None)
            buf = self.store.get(key)
            if buf is not None:
                self.store.discard_if(key, buf)

    async def handle_reduce_node(
        self, spec: dict[str, Any], slot: int, offset: int = 0
    ) -> dict[str, Any]:
        """RPC ``hoplite_reduce_node``: run node ``slot`` of a reduce tree (from
        byte ``offset``: a node replacing a dead one)."""
        w = self.worker
        assert w is not None
        s = ReduceSpec.from_msg(spec)
        key = s.inputs[slot]
        if s.rid in self._aborted:
            return {"status": "error", "message": "reduction aborted"}
        if key not in w.data:
            return {
                "status": "error",
                "message": f"input {key!r} of the reduction is not in memory on {w.address}",
            }
        try:
            value = select_field(w.data[key], s.field, key)
        except ReduceInputError as e:
            return {"status": "error", "input_error": True, "message": str(e)}
        task = asyncio.create_task(self.run_node_until_sent(s, slot, value, offset))
        try:
            with self._tracked(s.rid, task):
                await task
            return {"status": "OK"}
        except ReduceInputError as e:
            return {"status": "error", "input_error": True, "message": str(e)}
        except asyncio.CancelledError:
            return {"status": "error", "message": "reduction aborted"}
        except Exception as e:
            logger.warning("reduce node %d of %s failed", slot, s.rid, exc_info=True)
            return {"status": "error", "message": f"{type(e).__name__}: {e}"}

    @contextlib.contextmanager
    def _tracked(self, rid: str, task: asyncio.Task[Any]) -> Iterator[None]:
        """Register ``task`` as part of reduction ``rid`` (so an abort cancels it)."""
        self._reductions.setdefault(rid, set()).add(task)
        try:
            yield
        finally:
            tasks = self._reductions.get(rid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._reductions[rid]

    def handle_reduce_abort(self, rid: str) -> None:
        """RPC ``hoplite_reduce_abort``: stop this worker's nodes of ``rid``
        (and refuse the ones that have not arrived yet)."""
        self._aborted.append(rid)
        for t in self._reductions.get(rid, ()):
            t.cancel()
        self._drop_partials(rid)

    def _drop_partials(self, rid: str) -> None:
        """Fail and release every partial result of reduction ``rid`` here (a
        failed buffer also wakes whatever still waits on it)."""
        for key in [k for k in self.store.buffers if is_partial_key(k) and k[1] == rid]:  # type: ignore[index]
            self.store.release(key)
        # Peers waiting for a partial result of rid to appear: stop waiting.
        for key, fut in list(self._announced.items()):
            if is_partial_key(key) and key[1] == rid and not fut.done():  # type: ignore[index]
                fut.set_result(None)

    async def run_reduction(self, value: Any, spec_msg: dict[str, Any]) -> Any:
        """The root of a reduce tree: start the other nodes, combine, return
        the result (raising the clearest error if any node failed).

        A plain reduction whose tree breaks (a participant died or stalled)
        is restarted: the inputs are located again (the scheduler recomputes
        lost ones from their lineage) and a new tree runs, at most
        ``hoplite.resume-attempts`` times. Inputs that do not fit are not
        retried: their error is final."""
        w = self.worker
        assert w is not None
        spec = ReduceSpec.from_msg(spec_msg)
        root = spec.root
        op = resolve_op(spec.op)
        value = check_input(value, spec.inputs[root])
        # The root's input defines the shape and dtype every input must have.
        spec = dataclasses.replace(spec, shape=value.shape, dtype=value.dtype.str)
        restartable = not spec.copies and spec.segment is None
        if spec.addresses[root] != w.address:  # Dask ran the root elsewhere
            spec = await self._relocated(spec, set())
        failed: set[str] = set()  # workers that did not answer their node's call
        for attempt in range(self.config.max_resumes + 1):
            try:
                t1 = time()
                result = await self._reduce_once(spec, value)
                logger.debug("reduction %s took %.2fs", spec.rid, time() - t1)
                break
            except ReduceInputError:
                raise
            except Exception as e:
                if not restartable or attempt == self.config.max_resumes:
                    raise
                if isinstance(e, NodeFailed) and e.unreachable:
                    failed.add(e.address)
                logger.warning(
                    "reduction %s broke (%s: %s); restarting with the inputs located again",
                    spec.rid,
                    type(e).__name__,
                    e,
                )
                self._count("reduce-restarts")
                t0 = time()
                old_rid = spec.rid
                spec = await self._relocated(spec, failed)
                logger.info(
                    "reduction %s restarts as %s: inputs located again in %.2fs",
                    old_rid,
                    spec.rid,
                    time() - t0,
                )
                logger.debug(
                    "reduction %s: parents %s, workers %s", spec.rid, spec.parent, spec.addresses
                )
        if not spec.children(root):  # a single input: its buffer is the input itself
            result = result.copy()
        op.finish(result, len(spec.inputs))
        return result

    async def _relocated(self, spec: ReduceSpec, avoid: set[str]) -> ReduceSpec:
        """``spec`` with a new id and every input's current holder (this worker
        for the root's), waiting while the scheduler recomputes lost inputs;
        holders in ``avoid`` (they just failed) only if there is no other."""
        w = self.worker
        assert w is not None
        keys = list(spec.inputs)
        # A lost input is recomputed by the scheduler (waiting, queued,
        # processing...): wait for it, up to queue-timeout of no change; one
        # that cannot come back (erred, or never computed by a task) is final.
        deadline = time() + self.config.queue_timeout
        # A worker that just failed is often dead but not yet removed by the
        # scheduler: give it a stall timeout to drop out of who_has before
        # using it again as the only holder of an input.
        shun_until = time() + self.config.stall_timeout
        last: dict[Key, str | None] = {}
        while True:
            who_has = await w.scheduler.who_has(keys=keys)
            missing = [k for k in keys if not who_has.get(k)]
            if not missing:
                shunned = [
                    k
                    for slot, k in enumerate(keys)
                    if slot != spec.root and set(who_has[k]) <= avoid
                ]
                if not shunned or time() > shun_until:
                    break
                await asyncio.sleep(0.1)
                continue
            states = await w.scheduler.hoplite_key_states(keys=missing)
            _raise_if_gone_for_good({k: states.get(k) for k in missing})
            if states != last:
                last, deadline = states, time() + self.config.queue_timeout
            elif time() > deadline:
                raise RuntimeError(
                    f"input {missing[0]!r} of the reduction was lost and has not been "
                    f"recomputed (stuck in state {states.get(missing[0])!r} for "
                    f"{self.config.queue_timeout:g}s)"
                )
            await asyncio.sleep(0.1)
        addresses = []
        for slot, key in enumerate(keys):
            holders = sorted(who_has[key])
            if slot == spec.root:
                addresses.append(w.address)
            elif spec.addresses[slot] in holders and spec.addresses[slot] not in avoid:
                addresses.append(spec.addresses[slot])
            else:
                good = [h for h in holders if h not in avoid] or holders
                addresses.append(good[0])
        # A lost input is often recomputed on a worker holding another one:
        # put the two next to each other in the tree.
        order = colocated_order(spec.parent, addresses, spec.root)
        return dataclasses.replace(
            spec,
            rid=uuid.uuid4().hex,
            inputs=tuple(keys[i] for i in order),
            addresses=tuple(addresses[i] for i in order),
        )

    async def _reduce_once(self, spec: ReduceSpec, value: Any) -> Any:
        # With allreduce copies, the first one streams the root's partial result
        # while it fills: hold it until that copy has all of it (and only then
        # finish a mean in place). Registered before the node runs, so that a
        # copy finishing early is not missed.
        async with self._held_until_sent(spec.partial_key(spec.root), hold=bool(spec.copies)):
            return await self._run_root(spec, value)

    async def _start_node(self, spec: ReduceSpec, slot: int, offset: int = 0) -> None:
        """Run node ``slot`` of ``spec`` on its worker, until it is done."""
        w = self.worker
        assert w is not None
        addr = spec.addresses[slot]
        try:
            reply = await w.rpc(addr).hoplite_reduce_node(
                spec=spec.to_msg(), slot=slot, offset=offset
            )
        except Exception as e:
            raise NodeFailed(
                f"node {slot} on {addr}: {type(e).__name__}: {e}", addr, unreachable=True
            ) from e
        if reply.get("status") != "OK":
            if reply.get("input_error"):
                raise ReduceInputError(reply.get("message"))
            raise NodeFailed(str(reply.get("message")), addr)

    async def _run_root(self, spec: ReduceSpec, value: Any) -> Any:
        """Run the root node while starting the others; on the first failure
        (or when cancelled) abort everything and raise the clearest error.

        A node whose worker died is not a failure yet: its parent asks for a
        replacement (:meth:`handle_reduce_replace`), which joins the tree
        where the dead node was. Only if none is asked for within a stall
        timeout does the tree count as broken. (Plain reductions only: an
        allreduce's copies and segments have their own fallback.)

        Once the root's own node has finished, every node's partial result has
        been streamed up the tree, so the nodes' replies are only waited for
        one stall timeout more (a node whose worker hangs after sending must
        not hold the result back)."""
        root = spec.root
        repair = TreeRepair(
            spec,
            budget=self.config.max_resumes if not spec.copies and spec.segment is None else 0,
            grace=self.config.stall_timeout,
        )
        slot_of: dict[asyncio.Task[Any], int] = {
            asyncio.create_task(self._start_node(spec, i)): i
            for i in range(len(spec.inputs))
            if i != root
        }
        current = {i: t for t, i in slot_of.items()}  # the task running each node now
        own = asyncio.create_task(run_node(self, spec, root, value))
        tasks: set[asyncio.Task[Any]] = {*slot_of, own}
        pending = set(tasks)
        failed: list[asyncio.Task[Any]] = []
        joined: asyncio.Queue[tuple[int, asyncio.Task[Any]]] = asyncio.Queue()
        self._roots.add(spec.rid)
        self._repairs[spec.rid] = _RootRepair(repair, current, joined)
        try:
            while pending and not failed:
                own_ok = own.done() and not own.cancelled() and own.exception() is None
                timeout = self.config.stall_timeout if own_ok else None
                deadline = repair.next_deadline()
                if deadline is not None:
                    timeout = max(0.0, min(timeout or math.inf, deadline - time()))
                wake: asyncio.Task[Any] = asyncio.create_task(joined.get())
                done, pending = await asyncio.wait(
                    pending | {wake}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(wake)
                if wake.done():
                    done.discard(wake)
                    new_slot, new_task = wake.result()
                    slot_of[new_task] = new_slot
                    tasks.add(new_task)
                    pending.add(new_task)
                else:
                    wake.cancel()
                failed = []
                for t in done:
                    if t.cancelled() or t.exception() is None:
                        continue
                    e = t.exception()
                    at = slot_of.get(t)
                    if at is not None and current.get(at) is not t:
                        continue  # a node replaced already
                    if (
                        at is not None
                        and isinstance(e, NodeFailed)
                        and e.unreachable
                        and repair.refusal(at) is None
                    ):
                        repair.node_died(at, time())
                        continue
                    failed.append(t)
                failed += [current[s] for s in repair.unrepaired(time())]
                if own_ok and failed:
                    # The result was complete before this node's reply came:
                    # its failure (say, it hung up after sending) changes nothing.
                    logger.info(
                        "reduction %s: a node failed after the result: %s",
                        spec.rid,
                        [t.exception() for t in failed if t.done() and not t.cancelled()],
                    )
                    failed = []
                if not done and own_ok and not wake.done():
                    logger.info(
                        "reduction %s: %d node(s) did not confirm within %gs of the result",
                        spec.rid,
                        len(pending),
                        self.config.stall_timeout,
                    )
                    _cancel_quietly(pending)
                    break
        except BaseException:  # cancelled from outside
            repair.closed = True
            self._abort_tree(repair.spec, tasks)
            raise
        finally:
            repair.closed = True
            self._roots.discard(spec.rid)
            self._repairs.pop(spec.rid, None)
            while not joined.empty():  # a replacement started after the loop's last look
                _, late = joined.get_nowait()  # is of no use any more
                tasks.add(late)
                _cancel_quietly([late])
        if failed:
            self._abort_tree(repair.spec, tasks)
            errors = [t.exception() if t.done() and not t.cancelled() else None for t in failed]
            if not any(errors):
                errors = [NodeFailed(f"a node of {spec.rid} died and was not replaced", "")]
            raise next(
                (e for e in errors if isinstance(e, ReduceInputError)),
                next(e for e in errors if e is not None),
            )
        if repair.used:
            self._count("reduce-repairs", repair.used)
        return await self._deserialize(own.result())

    async def handle_reduce_replace(
        self, rid: str, slot: int, offset: int, dead: str
    ) -> dict[str, Any]:
        """RPC ``hoplite_reduce_replace``, to the root of reduction ``rid``:
        node ``slot`` on worker ``dead`` broke its parent's stream at byte
        ``offset``. Start a replacement where its input is (waiting while
        Dask recomputes it) and return that worker's address; refuse if the
        node failed otherwise than by its worker dying."""
        state = self._repairs.get(rid)
        if state is None:
            return {"status": "error", "message": f"reduction {rid} is not running here"}
        repair, current, joined = state.repair, state.current, state.joined
        why = repair.refusal(slot)
        if why is None:
            # Its node's own call tells a dead worker (the call breaks) from a
            # node that failed on its own (it answers): wait for it, briefly.
            task = current.get(slot)
            if task is not None:
                await asyncio.wait({task}, timeout=self.config.stall_timeout)
            if task is None or not task.done() or task.cancelled():
                why = f"node {slot} on {dead} is not known to have died"
            elif not (isinstance(e := task.exception(), NodeFailed) and e.unreachable):
                why = f"node {slot} on {dead} failed: {e}"
        if why is None:
            why = repair.refusal(slot)  # the tree may have ended meanwhile
        if why is not None:
            logger.info("not replacing node %d of reduction %s: %s", slot, rid, why)
            return {"status": "error", "message": why}
        repair.begin(slot)
        try:
            address = await self._holder_of(repair.spec.inputs[slot], avoid=dead)
        except Exception as e:
            repair.abandon(slot)
            return {"status": "error", "message": f"{type(e).__name__}: {e}"}
        if repair.closed:
            repair.abandon(slot)
            return {"status": "error", "message": f"reduction {rid} is no longer running"}
        spec = repair.replaced(slot, address)
        task = asyncio.create_task(self._start_node(spec, slot, offset))
        current[slot] = task
        joined.put_nowait((slot, task))
        logger.info(
            "reduction %s: node %d on %s died; replaced on %s from byte %d",
            rid,
            slot,
            dead,
            address,
            offset,
        )
        return {"status": "OK", "address": address}

    async def _holder_of(self, key: Key, avoid: str) -> str:
        """A worker holding ``key`` other than ``avoid``, waiting while the
        scheduler recomputes it (up to ``directory.queue-timeout`` without a
        change of its state)."""
        w = self.worker
        assert w is not None
        deadline = time() + self.config.queue_timeout
        last: str | None = None
        while True:
            who_has = await w.scheduler.who_has(keys=[key])
            holders = sorted(set(who_has.get(key) or ()) - {avoid})
            if holders:
                return holders[0]
            state = (await w.scheduler.hoplite_key_states(keys=[key])).get(key)
            _raise_if_gone_for_good({key: state})
            if state != last:
                last, deadline = state, time() + self.config.queue_timeout
            elif time() > deadline:
                raise RuntimeError(
                    f"input {key!r} of the reduction is only on {avoid} and stayed "
                    f"{state!r} for {self.config.queue_timeout:g}s"
                )
            await asyncio.sleep(0.05)

    async def replace_child(
        self, spec: ReduceSpec, slot: int, offset: int, dead: str, error: Exception
    ) -> str:
        """Ask the root of ``spec`` for a replacement of child node ``slot``
        whose stream broke (``error``) at byte ``offset``; its new address.
        Raises ``error`` if the root refuses."""
        w = self.worker
        assert w is not None
        root = spec.addresses[spec.root]
        logger.info(
            "child %d of reduction %s on %s broke at byte %d (%s: %s); asking the root",
            slot,
            spec.rid,
            dead,
            offset,
            type(error).__name__,
            error,
        )
        try:
            reply = await asyncio.wait_for(
                w.rpc(root).hoplite_reduce_replace(
                    rid=spec.rid, slot=slot, offset=offset, dead=dead
                ),
                self.config.queue_timeout + 2 * self.config.stall_timeout,
            )
        except Exception as e:
            raise error from e
        if reply.get("status") != "OK":
            raise error
        self._count("reduce-children-replaced")
        return str(reply["address"])

    def _abort_tree(self, spec: ReduceSpec, tasks: set[asyncio.Task[Any]]) -> None:
        """Stop every node and copy of reduction ``spec`` (this worker's
        ``tasks`` too) and drop its partial results here."""
        w = self.worker
        assert w is not None
        _cancel_quietly(tasks)
        aborts = asyncio.gather(
            *(
                w.rpc(a).hoplite_reduce_abort(rid=spec.rid)
                for a in set(spec.addresses) | set(spec.copies)
            ),
            return_exceptions=True,
        )
        # Not waited for: a live peer gets it within a round trip, while a
        # dead one is retried by Dask's connect for comm.timeouts.connect
        # and a hung one never answers. A restart uses a new id anyway.
        self._background.add(aborts)
        aborts.add_done_callback(self._background.discard)
        self._drop_partials(spec.rid)

    async def run_allreduce_part(
        self, value: Any, spec_msgs: list[dict[str, Any]], mine: int
    ) -> Any:
        """One worker's part of a segmented allreduce: the root of segment
        ``mine`` (its reduce tree and the chain of copies streaming its result
        run concurrently with everyone else's), a copy of every other segment,
        then the whole result assembled from the segments."""
        specs = [ReduceSpec.from_msg(m) for m in spec_msgs]
        w = self.worker
        assert w is not None
        me = w.address
        mine_spec = specs[mine]
        if mine_spec.addresses[mine_spec.root] != me:
            # Dask ran this part on another worker (its own died): the
            # segments' pipelines are broken; reduce everything here.
            return await self.reduce_anew(mine_spec, mine_spec.root, value)
        try:
            return await self._allreduce_part(value, spec_msgs, specs, mine)
        except ReduceInputError:
            raise
        except Exception as e:
            logger.warning(
                "segmented allreduce %s broke (%s: %s); reducing all inputs here",
                mine_spec.rid,
                type(e).__name__,
                e,
            )
            return await self.reduce_anew(mine_spec, mine_spec.root, value)

    async def _allreduce_part(
        self, value: Any, spec_msgs: list[dict[str, Any]], specs: list[ReduceSpec], mine: int
    ) -> Any:
        w = self.worker
        assert w is not None
        me = w.address
        tasks = [
            asyncio.create_task(self.run_reduction(value, spec_msgs[mine])),
            *(
                asyncio.create_task(self.pull_copy(spec_msgs[i], specs[i].copies.index(me)))
                for i in range(len(specs))
                if i != mine
            ),
        ]
        try:
            # The first failure ends the wait: the caller then reduces
            # everything itself, and the other segments are no use any more.
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            _cancel_quietly(tasks)
        errors: list[BaseException] = []
        for t in done:
            if t.cancelled():
                errors.append(RuntimeError("allreduce segment cancelled"))
            elif (e := t.exception()) is not None:
                errors.append(e)
        if errors or pending:
            raise next(
                (e for e in errors if isinstance(e, ReduceInputError)),
                errors[0] if errors else RuntimeError("allreduce segment cancelled"),
            )
        segments: list[np.ndarray] = [t.result() for t in tasks]
        order = [mine, *(i for i in range(len(specs)) if i != mine)]
        first = segments[0]
        full = dataclasses.replace(specs[mine], shape=np.shape(value))
        # From the buffer pool: fresh memory would be faulted in page by page
        # (measured: as much CPU as receiving the segments). The region goes
        # back to the pool when the result array dies (memoryview -> handle).
        count = math.prod(full.shape)
        mem = memoryview(self.store.pool.allocate(count * first.dtype.itemsize))  # type: ignore[arg-type]
        flat = np.frombuffer(mem, dtype=first.dtype, count=count)
        out = flat.reshape(full.shape)
        for i, seg in zip(order, segments, strict=True):
            lo, hi = dataclasses.replace(specs[i], shape=full.shape).bounds()
            flat[lo:hi] = seg
        return out

    async def reduce_anew(self, spec: ReduceSpec, slot: int, value: Any) -> Any:
        """The failure path of allreduce: the whole reduction of ``spec``'s
        inputs, as a plain (restartable) reduce tree rooted here with input
        ``slot`` (``value``: this worker's copy of it, or None to find one)."""
        w = self.worker
        assert w is not None
        self._count("allreduce-fallbacks")
        n = len(spec.inputs)
        if value is None:
            local = [i for i, k in enumerate(spec.inputs) if k in w.data]
            if local:
                slot, value = local[0], w.data[spec.inputs[local[0]]]
            else:
                who_has = await w.scheduler.who_has(keys=[spec.inputs[slot]])
                [value] = await self.fetch_parts(
                    [spec.inputs[slot]],
                    {spec.inputs[slot]: list(who_has.get(spec.inputs[slot]) or [])},
                )
        held_by = list(spec.addresses)
        held_by[slot] = w.address
        size = int(getattr(value, "nbytes", 0) or 0)
        plan, order = await self._plan_rooted_at(n, size, slot, held_by)
        addresses = [held_by[i] for i in order]
        plain = dataclasses.replace(
            spec,
            rid=uuid.uuid4().hex,
            inputs=tuple(spec.inputs[i] for i in order),
            addresses=tuple(addresses),
            parent=plan.parent,
            copies=(),
            segment=None,
            shape=(),
            dtype="",
        )
        return await self.run_reduction(value, plain.to_msg())

    # ------------------------------------------------- small allreduce

    async def handle_result(self, key: Key) -> dict[str, Any]:
        """RPC ``hoplite_result``: the value of ``key`` as soon as it is in
        memory here (the copies of a small allreduce ask its root's worker
        when they start, before the result exists).

        Replies ``wait`` when the key is still pending here after a stall
        timeout (ask again), ``missing`` when it is neither here nor coming
        (it failed, was released, or its task runs elsewhere)."""
        w = self.worker
        assert w is not None
        ts = w.state.tasks.get(key)
        if key not in w.data and not (ts is not None and ts.state == "error"):
            fut = asyncio.get_running_loop().create_future()
            waiters = self._result_waiters.setdefault(key, [])
            waiters.append(fut)
            try:
                await asyncio.wait_for(fut, self.config.stall_timeout)
            except asyncio.TimeoutError:
                ts = w.state.tasks.get(key)
                pending = ts is not None and ts.state not in ("error", "released", "forgotten")
                return {"status": "wait" if pending else "missing"}
            finally:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters and self._result_waiters.get(key) is waiters:
                    del self._result_waiters[key]
        if key not in w.data:
            return {"status": "missing"}
        return {"status": "OK", "value": to_serialize(w.data[key])}

    async def pull_result(
        self, key: Key, holder: str, op: str, inputs: list[Key], me: Key | None = None
    ) -> Any:
        """Task ``me``, a small allreduce's copy: the result ``key`` from the
        worker ``holder`` that computes it, asked for before it exists.

        A root Dask moved (stolen, or rerun after its worker died) is followed
        to its new worker. The copy leaves its worker's thread slots
        (``secede``) before any longer wait, as Dask's own tasks that wait do:
        the root, or an input it needs recomputed, may need that slot. If the
        root failed or is gone, the inputs are reduced here (their errors
        then surface here too)."""
        w = self.worker
        assert w is not None
        seceded = False
        pause = 0.01
        while True:
            if holder is not None:
                if holder == w.address:  # the root may need this worker's slot
                    seceded = self._secede(me, seceded)
                try:
                    reply = await asyncio.wait_for(
                        w.rpc(holder).hoplite_result(key=key), 2 * self.config.stall_timeout
                    )
                except (OSError, CommClosedError, asyncio.TimeoutError) as e:
                    logger.info("allreduce result %r unavailable from %s: %s", key, holder, e)
                    reply = {"status": "unreachable"}
                if reply["status"] == "OK":
                    self._count("results-pulled")
                    return reply["value"]
                if reply["status"] == "wait":  # still pending there, after a stall timeout
                    seceded = self._secede(me, seceded)
                    continue
            where = await w.scheduler.hoplite_task_worker(key=key)
            if where["state"] not in ("waiting", "queued", "no-worker", "processing", "memory"):
                break  # erred, released or forgotten: the root will not deliver
            if where["worker"] is None or where["worker"] == holder:
                # not assigned yet, or its worker has not heard of it yet
                seceded = self._secede(me, seceded)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
            holder = where["worker"]
        self._count("allreduce-fallbacks")
        who_has = await w.scheduler.who_has(keys=list(inputs))
        values = await self.fetch_parts(
            list(inputs), {k: list(who_has.get(k) or []) for k in inputs}
        )
        return await offload(reduce_values, op, list(inputs), values)

    def _secede(self, key: Key | None, seceded: bool) -> bool:
        """Take running task ``key`` (a coroutine) out of this worker's thread
        slots, once, as :func:`distributed.secede` does for a thread."""
        w = self.worker
        if not seceded and key is not None and w is not None:
            w.handle_stimulus(
                SecedeEvent(key=key, compute_duration=0.0, stimulus_id=f"hoplite-secede-{time()}")
            )
        return True

    async def run_copy(self, spec_msg: dict[str, Any], j: int) -> Any:
        """Allreduce copy ``j`` as a Dask task: :meth:`pull_copy`, or, if the
        pipeline broke (a worker died or stalled), the whole reduction here."""
        try:
            return await self.pull_copy(spec_msg, j)
        except ReduceInputError:
            raise
        except Exception as e:
            spec = ReduceSpec.from_msg(spec_msg)
            logger.warning(
                "allreduce copy %d of %s broke (%s: %s); reducing all inputs here",
                j,
                spec.rid,
                type(e).__name__,
                e,
            )
            return await self.reduce_anew(spec, spec.root, None)

    async def run_root(self, value: Any, spec_msg: dict[str, Any]) -> Any:
        """The root of a reduction as a Dask task: :meth:`run_reduction`; an
        allreduce root whose copies broke reduces anew (the copies do too)."""
        spec = ReduceSpec.from_msg(spec_msg)
        assert self.worker is not None
        if spec.copies and spec.addresses[spec.root] != self.worker.address:
            return await self.reduce_anew(spec, spec.root, value)  # its worker died
        try:
            return await self.run_reduction(value, spec_msg)
        except ReduceInputError:
            raise
        except Exception:
            if not spec.copies:
                raise
            return await self.reduce_anew(spec, spec.root, value)

    async def pull_copy(self, spec_msg: dict[str, Any], j: int) -> Any:
        """Allreduce copy ``j``: stream the result from the previous copy (or
        the root) while it is being reduced, serve the next copy likewise.
        An abort of the reduction (``hoplite_reduce_abort``) stops only this
        copy's stream, which then fails with an error (not a cancellation of
        its caller)."""
        w = self.worker
        assert w is not None
        spec = ReduceSpec.from_msg(spec_msg)
        if spec.rid in self._aborted:
            raise RuntimeError(f"reduction {spec.rid} was aborted; no result to copy")
        src_addr, src_key = spec.copy_source(j)
        key = spec.copy_key(j)
        buf = self.store.announce(key)
        self.announced(key)
        task = asyncio.create_task(self._pull_copy(spec, j, src_addr, src_key, buf))
        with self._tracked(spec.rid, task):
            try:
                await asyncio.wait({task})
            except BaseException:  # we were cancelled ourselves
                _cancel_quietly([task])
                buf.fail(RuntimeError("allreduce copy cancelled"))
                raise
        if task.cancelled():
            error: BaseException = RuntimeError(f"allreduce copy {j} of {spec.rid} was aborted")
        else:
            error = task.exception()  # type: ignore[assignment]
            if error is None:
                return task.result()
        buf.fail(error if isinstance(error, Exception) else RuntimeError(str(error)))
        raise error

    async def _pull_copy(
        self, spec: ReduceSpec, j: int, src_addr: str, src_key: Key, buf: ObjectBuffer
    ) -> Any:
        """Stream copy ``j`` into ``buf``; hold it until copy j+1 has it."""
        w = self.worker
        assert w is not None
        key = spec.copy_key(j)
        async with self._held_until_sent(key, hold=j + 1 < len(spec.copies)):
            comm = await connect(w.rpc, src_addr, self.config.stall_timeout)
            try:
                req = StreamRequest(
                    src_key, 0, spec.block_bytes, None, raw=raw_stream(comm) is not None
                )
                await receive_stream(comm, buf, req, stall_timeout=self.config.stall_timeout)
            except BaseException:
                drop(w.rpc, src_addr, comm)
                raise
            w.rpc.reuse(src_addr, comm)
            result = await self._deserialize(buf)
        resolve_op(spec.op).finish(result, len(spec.inputs))
        return result


def _raise_if_gone_for_good(states: dict[Key, str | None]) -> None:
    """Raise if a lost input cannot come back: the scheduler's state of it is
    erred, forgotten or unknown (anything else is a recomputation under way)."""
    for key, state in states.items():
        if state in (None, "erred", "forgotten"):
            raise RuntimeError(
                f"input {key!r} of the reduction was lost and cannot be recomputed "
                f"(scheduler state: {state or 'unknown'})"
            )


def _cancel_quietly(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel those of ``tasks`` not done yet, and collect every outcome when
    it comes without waiting for it (no "exception never retrieved")."""
    for t in tasks:
        if not t.done():
            t.cancel()
        t.add_done_callback(lambda t: t.cancelled() or t.exception())


def _run_graph_reduce(
    fn: GraphReduce, keys: list[Key], who_has: dict[Key, list[str]], nbytes: dict[Key, int]
) -> Any:
    """The task a worker runs in place of a dask.array aggregate it took over:
    a reduce tree over the parts where they live, then the aggregate's own
    finishing step; on any failure of the tree, Dask's way (fetch the parts
    here, run the aggregate)."""
    w = get_worker()
    plugin = w.plugins.get(PLUGIN_NAME)
    if isinstance(plugin, HopliteWorker) and plugin.worker is w:
        secede()  # only waits on the event loop; keep the thread slot free
        try:
            combined = sync(w.loop, plugin.graph_reduce, fn, keys, who_has, max(nbytes.values()))
            return fn.finish(combined)
        except ReduceInputError as e:
            logger.info("%r: computing the aggregate on fetched inputs (%s)", fn, e)
        except Exception as e:
            logger.warning(
                "%r: reduce tree failed (%s: %s); fetching the inputs", fn, type(e).__name__, e
            )
        plugin._count("graph-reduction-fallbacks")
        values = sync(w.loop, plugin.fetch_parts, keys, who_has)
    else:  # the plugin went away after the task arrived
        raise Reschedule()
    return fn(*values)
