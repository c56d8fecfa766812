"""What every component of the worker part shares, and nothing else.

:class:`WorkerContext` is built once by the plugin's ``setup`` and handed to
each component (receiver, sender, reduce nodes and roots, allreduce, the
aggregate takeover) in its constructor: the Dask worker, the block store, the
configuration, the counters and the recent-transfer log, the batched send to
the scheduler, and fire-and-forget task keeping. No component receives or
imports the plugin itself.

The configuration is read from the context at each use, so replacing
``context.config`` (tests shorten a timeout that way) reaches every component.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from dask.typing import Key
from distributed import secede
from distributed.metrics import context_meter, time
from distributed.protocol import deserialize, serialize
from distributed.utils import offload, sync
from distributed.worker import Worker

from dask_hoplite.compat import private
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.store import BlockStore, ObjectBuffer
from dask_hoplite.errors import CollectiveAborted, ReduceInputError
from dask_hoplite.features import ACCOUNTING, FEATURES
from dask_hoplite.worker.timelines import Timelines

if TYPE_CHECKING:
    from distributed.worker_state_machine import SecedeEvent

    from dask_hoplite.worker.host_sharing import HostSharing
else:  # a name a release dropped turns off its feature, not this import
    SecedeEvent = private("distributed.worker_state_machine", "SecedeEvent")

logger = logging.getLogger(__name__)

#: The name the worker part is registered under on every worker.
PLUGIN_NAME = "hoplite-worker"

T = TypeVar("T")

#: ``(keys, who_has) -> values``: the keys' values fetched here, by hoplite or
#: Dask's ``get_data`` (:meth:`~dask_hoplite.worker.receiver.Receiver.fetch_parts`).
FetchParts = Callable[[list[Key], dict[Key, list[str]]], Awaitable[list[Any]]]


@dataclasses.dataclass(eq=False)
class IncomingStream:
    """A stream into this worker, for the progress the heartbeat reports."""

    key: Key
    sender: str
    #: The buffer the stream fills (for a reduce node: the node's result,
    #: which advances as its children's blocks land).
    buf: ObjectBuffer
    #: "object" (a key's copy) or "reduce" (a child's partial result).
    kind: str
    #: The byte the stream started from: > 0 for a resumed stream or a
    #: repaired reduce node.
    start: int = 0


@dataclasses.dataclass
class WorkerContext:
    """The worker part's shared state: one per worker, built by the plugin."""

    worker: Worker
    store: BlockStore
    config: HopliteConfig
    #: Counters shown by ``hoplite_worker_info`` (bytes, keys, resumes...).
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The latest transfers into this worker: key, sender, bytes, and wall
    #: times of the directory request and the last byte.
    recent: deque[dict[str, Any]] = dataclasses.field(default_factory=lambda: deque(maxlen=100))
    #: Streams into this worker now.
    incoming: set[IncomingStream] = dataclasses.field(default_factory=set)
    #: How many streams out of this worker run now.
    outgoing: int = 0
    #: Reduce trees rooted here, by (kind, outcome).
    collectives: Counter[tuple[str, str]] = dataclasses.field(default_factory=Counter)
    #: Fire-and-forget calls, referenced until they finish.
    background: set[asyncio.Future[Any]] = dataclasses.field(default_factory=set)
    #: The plugin was torn down: components stop taking new work.
    closed: bool = False
    #: The features running on this worker (:mod:`dask_hoplite.features`).
    features: frozenset[str] = frozenset(FEATURES)
    #: Per-key timelines of fetches (``hoplite.timelines``; None: off).
    timelines: Timelines | None = None
    #: Keys whose serialised size a worker measured (Dask's ``sizeof`` has
    #: no rule for their type), by key: those computed here, and those a
    #: task sent here needs (:mod:`dask_hoplite.worker.measuring`).
    measured: dict[Key, int] = dataclasses.field(default_factory=dict)
    #: One copy per host (``hoplite.host-sharing``); None: off, or this
    #: platform has no shared regions.
    sharing: HostSharing | None = None

    @property
    def accounting(self) -> bool:
        """Whether hoplite's transfers go into Dask's own bookkeeping here."""
        return ACCOUNTING in self.features

    @property
    def address(self) -> str:
        return self.worker.address

    def count(self, name: str, n: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + n

    def event(self, action: str, **details: Any) -> None:
        """Count ``action`` and tell it to ``client.get_events("hoplite")``:
        something an operator wants to see (a resume, a fallback, a repair)."""
        self.count(action)
        with contextlib.suppress(Exception):  # no scheduler: the count stays
            self.worker.log_event("hoplite", {"action": action, "worker": self.address, **details})

    @contextlib.contextmanager
    def streaming_out(self) -> Iterator[None]:
        """Count a stream out of this worker while it runs."""
        self.outgoing += 1
        try:
            yield
        finally:
            self.outgoing -= 1

    @contextlib.contextmanager
    def receiving(self, key: Key, sender: str, buf: ObjectBuffer, kind: str) -> Iterator[None]:
        """A stream of ``key`` from ``sender`` into ``buf`` runs: it is in
        ``incoming`` (counted, and its progress in the heartbeat)."""
        stream = IncomingStream(key, sender, buf, kind, buf.progress)
        self.incoming.add(stream)
        try:
            yield
        finally:
            self.incoming.discard(stream)

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the scheduler on the worker's batched stream, if open."""
        bs = self.worker.batched_stream
        if bs is not None and bs.comm is not None and not bs.comm.closed():
            self.worker.batched_send(msg)

    def spawn(self, aw: Awaitable[Any]) -> asyncio.Future[Any]:
        """Run ``aw`` without waiting for it; keep it referenced until done."""
        fut = asyncio.ensure_future(aw)
        self.background.add(fut)
        fut.add_done_callback(self.background.discard)
        return fut

    def is_large(self, key: Key) -> bool:
        """Whether ``key``'s size reaches ``hoplite.min-bytes``: Dask's
        estimate, or its serialised size where a worker measured it."""
        ts = self.worker.state.tasks.get(key)
        if ts is None:
            return False
        return max(ts.nbytes or 0, self.measured.get(key, 0)) >= self.config.min_bytes

    async def serialize(self, value: Any) -> tuple[dict[str, Any], list[Any]]:
        """:func:`serialize_for_streams` of ``value``, off the event loop."""
        with context_meter.meter("serialize"):
            return await offload(serialize_for_streams, value)

    async def serialize_held(self, key: Key) -> tuple[dict[str, Any], list[Any]] | None:
        """The value of ``key`` in this worker's memory, serialised; None if
        the key is not in memory here, or was released (or released and
        computed again) while it was being serialised: a copy made from it
        would outlive the key here, as no transition of Dask's would release
        it again."""
        worker = self.worker
        if key not in worker.data:
            return None
        task = worker.state.tasks.get(key)
        header, frames = await self.serialize(worker.data[key])
        if key not in worker.data or worker.state.tasks.get(key) is not task:
            return None
        return header, frames

    async def deserialize(self, buf: ObjectBuffer) -> Any:
        """The object in the complete buffer ``buf``, deserialised off the loop."""
        assert buf.layout is not None
        # Dask's deserialize mutates headers (it pops collection keys); the
        # layout keeps serving other receivers, so give it a copy.
        header = copy.deepcopy(buf.layout.header)
        # A buffer in a shared region gives the task a private mapping.
        frames = buf.frames() if self.sharing is None else self.sharing.task_frames(buf)
        with context_meter.meter("deserialize"):
            return await offload(deserialize, header, frames)


def serialize_for_streams(value: Any) -> tuple[dict[str, Any], list[Any]]:
    """``value`` as hoplite serves it: header and frames (zero-copy for numpy
    arrays; pickled, buffers out of band, otherwise)."""
    return serialize(value, serializers=("dask", "pickle"), on_error="raise")


def secede_coroutine(worker: Worker, key: Key) -> None:
    """Take running task ``key``, a coroutine on ``worker``'s event loop,
    out of the worker's thread slots, as :func:`distributed.secede` does for
    a task's thread. A coroutine task that waits for other tasks must: Dask
    counts it against ``nthreads`` while it runs, and the tasks it waits for
    may need that very slot (with one thread per worker: a deadlock)."""
    worker.handle_stimulus(
        SecedeEvent(key=key, compute_duration=0.0, stimulus_id=f"hoplite-secede-{time()}")
    )


def run_on_loop(
    worker: Worker, fn: Callable[..., Awaitable[T]], *args: Any, seceded: bool = False
) -> T:
    """From a Dask task's thread: run coroutine function ``fn`` on the worker's
    event loop and return its result.

    The task leaves the worker's thread pool first (``secede``, unless it
    did already: ``seceded``): it only waits for the event loop, and a
    reduction that lost an input needs that input recomputed, possibly on
    this very worker, while it waits."""
    if not seceded:
        secede()
    return sync(worker.loop, fn, *args)


async def all_or_cancel(aws: Iterable[Awaitable[T]], what: str) -> list[T]:
    """The results of ``aws``, run at once, in order. The first failure
    cancels the others (a reduce tree's root then aborts its nodes on their
    workers, rather than leaving them streaming for a result nobody will
    take) and is raised; of several, an error naming a bad input first.
    ``what`` names one of them in the error of a cancelled one."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        cancel_quietly(tasks)
    errors: list[BaseException] = []
    for t in done:
        if t.cancelled():
            errors.append(CollectiveAborted(f"{what} cancelled"))
        elif (e := t.exception()) is not None:
            errors.append(e)
    if errors or pending:
        raise next(
            (e for e in errors if isinstance(e, ReduceInputError)),
            errors[0] if errors else CollectiveAborted(f"{what} cancelled"),
        )
    return [t.result() for t in tasks]


def cancel_quietly(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel those of ``tasks`` not done yet, and collect every outcome when
    it comes without waiting for it (no "exception never retrieved")."""
    for t in tasks:
        if not t.done():
            t.cancel()
        t.add_done_callback(lambda t: t.cancelled() or t.exception())
