"""The first ``k`` of a reduction's inputs to be ready, chosen on the scheduler.

A reduction is submitted at once (:mod:`dask_hoplite.collectives`); its
planning task asks ``hoplite_first_ready`` and gets the answer when ``k`` of
the inputs are in memory, with where they are and how big, in one long-poll.
Inputs are chosen in the order they became ready; an input whose holder died
is simply not ready (Dask recomputes it), so a spare that is ready is taken
instead when ``k < n``. An input that cannot come back (erred, forgotten,
unknown) ends the wait with its key and state.

The plugin forwards Dask's transitions (:meth:`FirstReady.key_transitioned`);
a waiter also looks again every ``recheck`` seconds, so a missed event costs
a delay, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed.utils import wait_for

from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.scheduler.gc_paused import gc_paused

if TYPE_CHECKING:
    from distributed.scheduler import TaskState


class FirstReady:
    """The RPC ``hoplite_first_ready``. ``task`` looks a key up in the
    scheduler's task states (``scheduler.tasks.get``)."""

    def __init__(
        self,
        task: Callable[[Key], TaskState | None],
        network: NetworkModel,
        recheck: float = 1.0,
    ) -> None:
        self._task = task
        self.network = network
        self.recheck = recheck
        self._seq = itertools.count()
        #: key -> when it became ready (for keys some waiter watches)
        self._ready_at: dict[Key, int] = {}
        #: key -> the events of the waiters that watch it
        self._watchers: dict[Key, set[asyncio.Event]] = {}

    def key_transitioned(self, key: Key, finish: str) -> None:
        events = self._watchers.get(key)
        if events is None:
            return
        if finish == "memory":
            self._ready_at.setdefault(key, next(self._seq))
        else:
            self._ready_at.pop(key, None)
        for event in events:
            event.set()

    def now(self, keys: list[Key], k: int) -> dict[str, Any] | None:
        """:meth:`first_ready`'s answer if it needs no wait (None: it does)."""
        return self._answer(keys, k)

    async def first_ready(self, keys: list[Key], k: int) -> dict[str, Any]:
        """When ``k`` of ``keys`` are in memory: ``{"chosen", "who_has",
        "nbytes", "network"}``; when so many cannot come back (erred,
        forgotten, unknown) that ``k`` never will be: ``{"failed": key,
        "state": its state or None}`` of the first of those."""
        event = asyncio.Event()
        try:
            with gc_paused():  # 1,024 watchers and the answer: no collection
                for key in keys:
                    self._watchers.setdefault(key, set()).add(event)
                answer = self._answer(keys, k)
            while answer is None:
                event.clear()
                try:
                    await wait_for(event.wait(), self.recheck)
                except asyncio.TimeoutError:
                    pass
                with gc_paused():
                    answer = self._answer(keys, k)
            return answer
        finally:
            with gc_paused():
                for key in keys:
                    watchers = self._watchers.get(key)
                    if watchers is not None:
                        watchers.discard(event)
                        if not watchers:
                            del self._watchers[key]
                            self._ready_at.pop(key, None)

    def _answer(self, keys: list[Key], k: int) -> dict[str, Any] | None:
        ready: list[tuple[int, int, Key]] = []
        failed: list[tuple[Key, str | None]] = []
        for i, key in enumerate(keys):
            ts = self._task(key)
            state = None if ts is None else ts.state
            if state in (None, "erred", "forgotten"):
                failed.append((key, state))
            elif state == "memory" and ts is not None and ts.who_has:
                # ready before anyone watched: first, in the caller's order
                ready.append((self._ready_at.get(key, -1), i, key))
        if len(ready) < k:
            if failed and len(keys) - len(failed) < k:  # k can no longer be ready
                key, why = failed[0]
                ts = self._task(key)
                exception = None if ts is None else ts.exception  # (serialized)
                return {"failed": key, "state": why, "exception": exception}
            return None
        chosen = [key for _, _, key in sorted(ready)[:k]]
        who_has: dict[Key, list[str]] = {}
        nbytes: dict[Key, int] = {}
        for key in chosen:
            ts = self._task(key)
            assert ts is not None
            who_has[key] = sorted(ws.address for ws in ts.who_has or ())
            nbytes[key] = max(ts.nbytes, 0)
        return {
            "chosen": chosen,
            "who_has": who_has,
            "nbytes": nbytes,
            "network": self.network.estimate().to_msg(),
        }
