"""This worker's share of the reduce trees that run through it: one registry.

A reduction is a tree of nodes on many workers (see
:mod:`dask_hoplite.worker.reduce_node` and :mod:`dask_hoplite.worker.reduce_root`).
What one worker must know about the trees it takes part in, by reduction id:

* the partial results announced here (a parent may ask for a node's partial
  result before the node started: the sender waits for the announcement,
  through the hooks it is given, :meth:`RunningReductions.coming` and
  :meth:`~RunningReductions.streamed`);
* the partial results a peer has read completely (an allreduce copy is held
  until its next copy took the last byte), and the ones a node's parent has
  released (a node holds its partial result until then: if its parent dies
  after reading all of it but before passing it all on, the parent's
  replacement reads it again);
* the node and copy tasks running here (an abort cancels them), and the ids
  aborted already (an abort may overtake its node's call);
* the latest run of each tree seen here: the scheduler numbers the runs of a
  request in order, so a message of an earlier run is stale and refused
  (:meth:`RunningReductions.refusal`), and a node of a later run ends what
  is left here of the earlier one;
* the roots running here, each one object (:class:`RootHandle`), which the
  plugin routes ``hoplite_reduce_replace`` and ``hoplite_reduce_running`` to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol

from dask.typing import Key

from dask_hoplite.core.reduce_spec import (
    LatestRuns,
    is_input_patch_key,
    is_partial_key,
    partial_key,
    run_name,
)
from dask_hoplite.core.store import ObjectBuffer
from dask_hoplite.errors import StaleRun
from dask_hoplite.timeouts import wait_for_future
from dask_hoplite.worker.context import WorkerContext

logger = logging.getLogger(__name__)


class RootHandle(Protocol):
    """A reduce tree's root running on this worker, as the registry sees it."""

    async def replace(self, slot: int, offset: int, dead: str) -> dict[str, Any]: ...


class RunningReductions:
    """The reduce trees this worker takes part in."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._announced: dict[Key, asyncio.Future[None]] = {}
        self._sent: dict[Key, asyncio.Future[None]] = {}
        self._released: dict[Key, asyncio.Future[None]] = {}
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._aborted: deque[str] = deque(maxlen=1000)
        self._latest = LatestRuns()
        #: The roots running here, by reduction id.
        self.roots: dict[str, RootHandle] = {}

    # ------------------------------------------------------ partial results

    def announced(self, key: Key) -> None:
        """A node created its partial buffer ``key``: wake waiting senders."""
        fut = self._announced.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def wait_announced(self, key: Key) -> bool:
        """Wait (up to a stall timeout) until the partial result ``key`` is
        announced here; False if it was not, or its reduction was aborted."""
        if self.is_aborted(str(key[1])):  # type: ignore[index]
            return False
        fut = self._announced.setdefault(key, asyncio.get_running_loop().create_future())
        try:
            await wait_for_future(fut, self.ctx.config.stall_timeout, shield=True)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if self._announced.get(key) is fut and fut.done():
                del self._announced[key]

    async def coming(self, key: Key) -> ObjectBuffer | None:
        """The sender's hook (:class:`~dask_hoplite.worker.sender.StreamHooks`):
        a reduce node's partial result asked for before its node started is
        served once the node announces it (None: any other key, or a node
        that did not start within a stall timeout)."""
        if not is_partial_key(key) or not await self.wait_announced(key):
            return None
        return self.ctx.store.get(key)

    def streamed(self, key: Key, buf: ObjectBuffer, whole: bool) -> None:
        """The sender's hook: a stream of ``key`` ended well. A partial result
        read to its end may be let go (:meth:`held_until_sent`); a dead
        node's input served for one patch is dropped."""
        if whole:
            self.sent(key)
        if is_input_patch_key(key):
            self.ctx.store.discard_if(key, buf)

    def sent(self, key: Key) -> None:
        """A peer has read all of the buffer of ``key``."""
        fut = self._sent.get(key)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def release(self, rid: str, slots: list[int]) -> None:
        """RPC ``hoplite_reduce_release``: the parent of nodes ``slots`` of
        reduction ``rid`` needs their partial results no more."""
        for slot in slots:
            fut = self._released.get(partial_key(rid, slot))
            if fut is not None and not fut.done():
                fut.set_result(None)

    @contextlib.asynccontextmanager
    async def held_until_sent(self, key: Key, hold: bool = True) -> AsyncIterator[None]:
        """Keep the buffer of ``key`` in the store after the body until a peer
        has streamed all of it (waiting at most a stall timeout); then
        release it."""
        async with self._held(key, self._sent, hold, None):
            yield

    @contextlib.asynccontextmanager
    async def held_until_released(
        self, key: Key, alive: Callable[[], Awaitable[bool]]
    ) -> AsyncIterator[None]:
        """Keep a node's partial result ``key`` in the store after the body
        until its parent releases it (:meth:`release`), which it does once its
        own parent released it, or the root has the result: each partial
        result stays until nothing can need it again. ``alive()`` is asked
        after each stall timeout of waiting: once the reduction no longer runs
        (finished or aborted, the release lost with a dead parent) the buffer
        goes."""
        async with self._held(key, self._released, True, alive):
            yield

    @contextlib.asynccontextmanager
    async def _held(
        self,
        key: Key,
        signals: dict[Key, asyncio.Future[None]],
        hold: bool,
        alive: Callable[[], Awaitable[bool]] | None,
    ) -> AsyncIterator[None]:
        stall = self.ctx.config.stall_timeout
        done = signals[key] = asyncio.get_running_loop().create_future()
        try:
            yield
            while hold:
                try:
                    await wait_for_future(done, stall, shield=True)
                    break
                except asyncio.TimeoutError:
                    if alive is None:
                        raise asyncio.TimeoutError(
                            f"no peer took all of {key!r} within {stall:g}s"
                        ) from None
                    if not await alive():
                        break
        finally:
            signals.pop(key, None)
            buf = self.ctx.store.get(key)
            if buf is not None:
                self.ctx.store.discard_if(key, buf)

    # ---------------------------------------------------- tasks and aborts

    @contextlib.contextmanager
    def tracked(self, rid: str, task: asyncio.Task[Any]) -> Iterator[None]:
        """Register ``task`` as part of reduction ``rid`` (so an abort cancels it)."""
        self._tasks.setdefault(rid, set()).add(task)
        try:
            yield
        finally:
            tasks = self._tasks.get(rid)
            if tasks is not None:
                tasks.discard(task)
                if not tasks:
                    del self._tasks[rid]

    def is_aborted(self, rid: str) -> bool:
        return rid in self._aborted

    def superseded(self, rid: str) -> StaleRun | None:
        """Whether tree ``rid`` is a stale run: one earlier than a run of the
        same tree (request and segment) seen here."""
        run = run_name(rid)
        if run is None:  # planned without the plugin: runs are not numbered
            return None
        latest = self._latest.get(run.tree)
        if latest is not None and run.number < latest:
            return StaleRun(f"reduction run {rid} is stale: run {latest} of the same tree started")
        return None

    def refusal(self, rid: str, starts: bool = False) -> StaleRun | str | None:
        """Why a message of tree ``rid`` is refused here (None: it is taken):
        a stale run (:meth:`superseded`, logged), or a run aborted here.

        A message that ``starts`` a node of a later run than any seen here
        aborts the earlier run's nodes and partial results here: its root
        restarted or died, or runs on a worker the scheduler removed, and
        nothing will read them."""
        stale = self.superseded(rid)
        if stale is not None:
            logger.warning("refused a message of a superseded run: %s", stale)
            return stale
        if self.is_aborted(rid):
            return f"reduction {rid} was aborted"
        run = run_name(rid)
        if run is None:
            return None
        latest = self._latest.get(run.tree)
        if starts and latest is not None and latest < run.number:
            self.abort(run.later(latest))
        self._latest.record(run.tree, run.number)
        return None

    def abort(self, rid: str) -> None:
        """RPC ``hoplite_reduce_abort``: stop this worker's nodes of ``rid``
        (and refuse the ones that have not arrived yet)."""
        self._aborted.append(rid)
        for t in self._tasks.get(rid, ()):
            t.cancel()
        self.drop_partials(rid)

    def drop_partials(self, rid: str) -> None:
        """Fail and release every partial result of reduction ``rid`` here (a
        failed buffer also wakes whatever still waits on it)."""
        store = self.ctx.store
        for key in [k for k in store.buffers if is_partial_key(k) and k[1] == rid]:  # type: ignore[index]
            store.release(key)
        # Peers waiting for a partial result of rid to appear: stop waiting.
        for key, fut in list(self._announced.items()):
            if key[1] == rid and not fut.done():  # type: ignore[index]
                fut.set_result(None)

    def running(self, rid: str) -> bool:
        """RPC ``hoplite_reduce_running``: whether the root of ``rid`` runs here."""
        return rid in self.roots

    def close(self) -> None:
        """The plugin is torn down: cancel every node and copy running here."""
        for tasks in self._tasks.values():
            for t in tasks:
                t.cancel()
