"""The adapters that put the :class:`~dask_hoplite.worker.receiver.Receiver`
under Dask's own fetch paths.

:class:`DaskFetchPaths` replaces, on the worker instance:

* ``worker.gather_dep``: keys of at least ``hoplite.min-bytes`` are fetched
  through the receiver; the rest, and anything hoplite cannot fetch, go to
  Dask's original method. The returned event obeys the rules of Dask's state
  machine (same ``worker`` and ``total_nbytes`` as the instruction, keys left
  out of ``data`` mean "the peer lacks it", no exception escapes).
* ``worker.handlers["gather"]``: the endpoint of ``client.replicate`` and
  ``client.scatter(..., broadcast=True)``, likewise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.worker_state_machine import StateMachineEvent

from dask_hoplite.compat import private
from dask_hoplite.worker.context import WorkerContext
from dask_hoplite.worker.receiver import GONE, Receiver

if TYPE_CHECKING:
    from distributed.worker import WORKER_ANY_RUNNING
    from distributed.worker_state_machine import GatherDepSuccessEvent
else:  # a name a release dropped turns off its feature, not this import
    WORKER_ANY_RUNNING = private("distributed.worker", "WORKER_ANY_RUNNING")
    GatherDepSuccessEvent = private("distributed.worker_state_machine", "GatherDepSuccessEvent")

logger = logging.getLogger(__name__)

GatherDep = Callable[..., Awaitable[StateMachineEvent]]
Gather = Callable[..., Awaitable[dict[str, Any]]]


class DaskFetchPaths:
    """Dask's two fetch entry points with large keys taken by a :class:`Receiver`.

    ``original_gather_dep`` / ``original_gather``: Dask's own methods, which
    get every key hoplite does not take."""

    def __init__(
        self,
        ctx: WorkerContext,
        receiver: Receiver,
        original_gather_dep: GatherDep,
        original_gather: Gather,
    ) -> None:
        self.ctx = ctx
        self.receiver = receiver
        self.original_gather_dep = original_gather_dep
        self.original_gather = original_gather
        #: Fetches started ahead of Dask's turn for them (see ``_prefetch``).
        self.prefetching: set[asyncio.Task[None]] = set()

    def _prefetch_siblings(self, peer: str, to_gather: Collection[Key]) -> None:
        """Start fetching the other large keys this worker needs from ``peer``.

        Dask fetches from one peer one batch at a time, and a batch holds at
        most ``distributed.worker.transfer.message-bytes-limit``: a task with
        two large dependencies on one holder (the parts of a split-tree
        broadcast) would get the second only after the first. Hoplite streams
        each key from the sender its directory picks, so they can come at
        once; Dask's turn for a key then finds it complete here, or joins the
        fetch still running."""
        w = self.ctx.worker
        for ts in list(w.state.data_needed.get(peer, ())):
            k = ts.key
            if (
                k in to_gather
                or ts.state != "fetch"
                or not self.ctx.is_large(k)
                or self.receiver.is_fetching(k)
                or self.ctx.store.get(k) is not None
            ):
                continue
            task = asyncio.create_task(self._prefetch(k))
            self.prefetching.add(task)
            task.add_done_callback(self.prefetching.discard)

    async def _prefetch(self, key: Key) -> None:
        try:
            await self.receiver.fetch(key)
        except Exception as e:  # Dask's own turn for the key fetches it again
            logger.debug("prefetch of %r failed: %s", key, e)
        self.receiver.senders.pop(key, None)
        self.receiver.holders.pop(key, None)

    def close(self) -> None:
        for task in list(self.prefetching):
            task.cancel()

    async def gather_dep(
        self,
        worker: str,
        to_gather: Collection[Key],
        total_nbytes: int,
        *,
        stimulus_id: str,
    ) -> StateMachineEvent:
        """Dask's ``Worker.gather_dep`` with large keys fetched through hoplite."""
        w, orig = self.ctx.worker, self.original_gather_dep
        large = [k for k in to_gather if self.ctx.is_large(k)]
        if not large or self.ctx.closed or w.status not in WORKER_ANY_RUNNING:
            return await orig(worker, to_gather, total_nbytes, stimulus_id=stimulus_id)
        logger.debug(
            "gather_dep from %s: %d key(s), %d through hoplite", worker, len(to_gather), len(large)
        )
        # Dask's story of a fetch: what was asked of whom, and what came from
        # whom (the senders hoplite's directory chose, not necessarily Dask's peer).
        w.state.log.append(("request-dep", worker, set(large), stimulus_id, time.time()))
        self._prefetch_siblings(worker, to_gather)
        results = await asyncio.gather(
            *(self.receiver.fetch(k) for k in large), return_exceptions=True
        )
        data: dict[Key, Any] = {}
        gone: set[Key] = set()
        by_sender: dict[str, set[Key]] = {}
        for key, res in zip(large, results, strict=True):
            sender = self.receiver.senders.pop(key, worker)
            if isinstance(res, BaseException):
                logger.error("hoplite fetch of %r raised", key, exc_info=res)
            elif res[0]:
                data[key] = res[1]
                by_sender.setdefault(sender, set()).add(key)
            elif res[1] is GONE or worker not in self.receiver.holders.get(key, [worker]):
                gone.add(key)
            self.receiver.holders.pop(key, None)
        # Keys no longer in memory anywhere, or no longer on the peer Dask
        # picked: Dask's holder is stale (dead, or the key is being
        # recomputed). Leaving them out of ``data`` tells the state machine
        # this peer lacks them, so it asks the scheduler where they are now
        # instead of trying a dead peer until its connect timeout.
        for sender, keys in sorted(by_sender.items()):
            w.state.log.append(("receive-dep", sender, keys, stimulus_id, time.time()))
        rest = [k for k in to_gather if k not in data and k not in gone]
        if not rest:
            return GatherDepSuccessEvent(
                worker=worker,
                total_nbytes=total_nbytes,
                data=data,
                stimulus_id=f"hoplite-gather-dep-success-{time.time()}",
            )
        ev = await orig(worker, rest, total_nbytes, stimulus_id=stimulus_id)
        if isinstance(ev, GatherDepSuccessEvent):
            ev.data.update(data)
        # Otherwise the keys go back to `fetch`; what hoplite fetched stays in
        # the store as a complete buffer and the retry finds it there.
        return ev

    async def gather(self, who_has: dict[Key, list[str]]) -> dict[str, Any]:
        """The ``gather`` endpoint (``client.replicate``, ``scatter(broadcast=True)``)."""
        w = self.ctx.worker
        wanted = [k for k in who_has if k not in w.data]
        results = await asyncio.gather(
            *(self.receiver.fetch(k) for k in wanted), return_exceptions=True
        )
        for k in wanted:
            self.receiver.senders.pop(k, None)
        data = {
            k: r[1]
            for k, r in zip(wanted, results, strict=True)
            if not isinstance(r, BaseException) and r[0]
        }
        if data:
            w.update_data(data=data, stimulus_id=f"hoplite-gather-{time.time()}")
        rest = {k: v for k, v in who_has.items() if k not in data}
        if not rest:
            return {"status": "OK"}
        return await self.original_gather(who_has=rest)
