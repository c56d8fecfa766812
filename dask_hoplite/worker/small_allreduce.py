"""Allreduce of small objects: copies that pull the result from the root's worker.

One Dask task reduces the inputs on the first input's worker, as Dask would;
the copies, one task per other worker, start at the same time and ask that
worker for the result (``hoplite_result``), which answers the moment the
result is in memory there (see :mod:`dask_hoplite.collectives` for why this
beats copies that depend on the result in Dask's graph). A copy follows a root
that Dask moved, and reduces the inputs itself if the root failed or is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dask.typing import Key
from distributed.comm.core import CommClosedError
from distributed.protocol import to_serialize
from distributed.utils import offload, wait_for

from dask_hoplite.core.reduce_spec import reduce_values
from dask_hoplite.timeouts import wait_for_future
from dask_hoplite.worker.context import FetchParts, WorkerContext, secede_coroutine

logger = logging.getLogger(__name__)

#: Scheduler states of a task that will still deliver a result.
COMING = ("waiting", "queued", "no-worker", "processing", "memory")


class SmallAllreduce:
    """The root's answers and the copies' pulls of small allreduces."""

    def __init__(self, ctx: WorkerContext, fetch_parts: FetchParts) -> None:
        self.ctx = ctx
        self.fetch_parts = fetch_parts
        #: ``hoplite_result`` requests waiting for a task of this worker to finish.
        self._waiters: dict[Key, list[asyncio.Future[None]]] = {}

    def task_finished(self, key: Key, finish: str) -> None:
        """Dask moved task ``key`` to ``finish`` here: wake its waiters."""
        if finish in ("memory", "error", "released", "forgotten"):
            for fut in self._waiters.pop(key, ()):
                if not fut.done():
                    fut.set_result(None)

    async def handle_result(self, key: Key) -> dict[str, Any]:
        """RPC ``hoplite_result``: the value of ``key`` as soon as it is in
        memory here (the copies of a small allreduce ask its root's worker
        when they start, before the result exists).

        Replies ``wait`` when the key is still pending here after a stall
        timeout (ask again), ``missing`` when it is neither here nor coming
        (it failed, was released, or its task runs elsewhere)."""
        w = self.ctx.worker
        ts = w.state.tasks.get(key)
        if key not in w.data and not (ts is not None and ts.state == "error"):
            fut = asyncio.get_running_loop().create_future()
            waiters = self._waiters.setdefault(key, [])
            waiters.append(fut)
            try:
                await wait_for_future(fut, self.ctx.config.stall_timeout)
            except asyncio.TimeoutError:
                ts = w.state.tasks.get(key)
                pending = ts is not None and ts.state not in ("error", "released", "forgotten")
                return {"status": "wait" if pending else "missing"}
            finally:
                if fut in waiters:
                    waiters.remove(fut)
                if not waiters and self._waiters.get(key) is waiters:
                    del self._waiters[key]
        if key not in w.data:
            return {"status": "missing"}
        return {"status": "OK", "value": to_serialize(w.data[key])}

    async def pull_result(
        self, key: Key, holder: str | None, op: str, inputs: list[Key], me: Key | None = None
    ) -> Any:
        """Task ``me``, a small allreduce's copy: the result ``key`` from the
        worker ``holder`` that computes it, asked for before it exists.

        A root Dask moved (stolen, or rerun after its worker died) is followed
        to its new worker. The copy leaves its worker's thread slots
        (``secede``) before any longer wait, as Dask's own tasks that wait do:
        the root, or an input it needs recomputed, may need that slot. If the
        root failed or is gone, the inputs are reduced here (their errors
        then surface here too)."""
        w = self.ctx.worker
        seceded = False
        pause = 0.01
        while True:
            if holder is not None:
                if holder == w.address:  # the root may need this worker's slot
                    seceded = self._secede(me, seceded)
                reply = await self._ask(holder, key)
                if reply["status"] == "OK":
                    self.ctx.count("results-pulled")
                    return reply["value"]
                if reply["status"] == "wait":  # still pending there, after a stall timeout
                    seceded = self._secede(me, seceded)
                    continue
            where = await w.scheduler.hoplite_task_worker(key=key)
            if where["state"] not in COMING:
                break  # erred, released or forgotten: the root will not deliver
            if where["worker"] is None or where["worker"] == holder:
                # not assigned yet, or its worker has not heard of it yet
                seceded = self._secede(me, seceded)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 1.0)
            holder = where["worker"]
        self.ctx.event("allreduce-fallbacks", path="small-allreduce")
        who_has = await w.scheduler.who_has(keys=list(inputs))
        values = await self.fetch_parts(
            list(inputs), {k: list(who_has.get(k) or []) for k in inputs}
        )
        return await offload(reduce_values, op, list(inputs), values)

    async def _ask(self, holder: str, key: Key) -> dict[str, Any]:
        if holder == self.ctx.address:  # e.g. an allreduce output of this worker
            reply = await self.handle_result(key)
            if reply["status"] == "OK":
                reply["value"] = reply["value"].data  # this worker's object, no copy
            return reply
        try:
            return await wait_for(
                self.ctx.worker.rpc(holder).hoplite_result(key=key),
                2 * self.ctx.config.stall_timeout,
            )
        except (OSError, CommClosedError, asyncio.TimeoutError) as e:
            logger.info("allreduce result %r unavailable from %s: %s", key, holder, e)
            return {"status": "unreachable"}

    def _secede(self, key: Key | None, seceded: bool) -> bool:
        """Take running task ``key`` (a coroutine) out of this worker's thread
        slots, once, as :func:`distributed.secede` does for a thread."""
        if not seceded and key is not None:
            secede_coroutine(self.ctx.worker, key)
        return True
