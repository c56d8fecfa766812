"""This worker's share of the reduce trees that run through it: one registry.

A reduction is a tree of nodes on many workers (see
:mod:`dask_hoplite.worker.reduce_node` and :mod:`dask_hoplite.worker.reduce_root`).
What one worker must know about the trees it takes part in, by reduction id:

* the partial results announced here (a parent may ask for a node's partial
  result before the node started: the sender waits for the announcement);
* the partial results a peer has read completely (a node holds its buffer
  until its parent took the last byte);
* the node and copy tasks running here (an abort cancels them), and the ids
  aborted already (an abort may overtake its node's call);
* the roots running here, each one object (:class:`RootHandle`), which the
  plugin routes ``hoplite_reduce_replace`` and ``hoplite_reduce_running`` to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Protocol

from dask.typing import Key

from dask_hoplite.core.reduce_spec import is_partial_key
from dask_hoplite.worker.context import WorkerContext


class RootHandle(Protocol):
    """A reduce tree's root running on this worker, as the registry sees it."""

    async def replace(self, slot: int, offset: int, dead: str) -> dict[str, Any]: ...


class RunningReductions:
    """The reduce trees this worker takes part in."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self._announced: dict[Key, asyncio.Future[None]] = {}
        self._sent: dict[Key, asyncio.Future[None]] = {}
        self._tasks: dict[str, set[asyncio.Task[Any]]] = {}
        self._aborted: deque[str] = deque(maxlen=1000)
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
            await asyncio.wait_for(asyncio.shield(fut), self.ctx.config.stall_timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            if self._announced.get(key) is fut and fut.done():
                del self._announced[key]

    def sent(self, key: Key) -> None:
        """A peer has read all of the buffer of ``key``."""
        fut = self._sent.get(key)
        if fut is not None and not fut.done():
            fut.set_result(None)

    @contextlib.asynccontextmanager
    async def held_until_sent(
        self,
        key: Key,
        hold: bool = True,
        alive: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[None]:
        """Keep the buffer of ``key`` in the store after the body, until a peer
        has streamed all of it; then release it. Waiting is bounded by the
        stall timeout, or, given ``alive``, lasts while ``alive()`` (asked
        after each stall timeout of waiting) says the reduction still runs."""
        stall = self.ctx.config.stall_timeout
        sent = self._sent[key] = asyncio.get_running_loop().create_future()
        try:
            yield
            while hold:
                try:
                    await asyncio.wait_for(asyncio.shield(sent), stall)
                    break
                except asyncio.TimeoutError:
                    if alive is None or not await alive():
                        raise asyncio.TimeoutError(
                            f"no peer took all of {key!r} within {stall:g}s"
                        ) from None
        finally:
            self._sent.pop(key, None)
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
