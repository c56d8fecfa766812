"""Cancelled collectives stop on their workers.

Dask lets a running task whose key nobody wants any more (the client
cancelled or dropped its future) run to its end. A collective's tasks
(a reduction's planning and result tasks, an allreduce's or allgather's
planning task and outputs) would go on: a reduce tree streaming, its partial
results held on every worker. :class:`CollectiveCancels` follows where each
of them runs and, when the scheduler forgets one while it runs, tells that
worker (stream op ``hoplite-cancel``), which stops it
(:mod:`dask_hoplite.worker.running_tasks`): the tree's root aborts its nodes
and every partial result is dropped.

A key that is only released (its plan was lost and is computed again, say)
is not forgotten: its run is left alone, as Dask leaves it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from dask.typing import Key

from dask_hoplite.core.protocol import CANCEL_OP

logger = logging.getLogger(__name__)

#: Key prefixes of the collectives' tasks that run as coroutines and stop
#: when cancelled.
PREFIXES = ("hoplite-reduce-", "hoplite-allreduce-", "hoplite-plan-")


class CollectiveCancels:
    """Where each running collective task runs, and the stop sent to it when
    its key is forgotten. ``send(worker, msg)`` sends on the scheduler's
    stream to that worker."""

    def __init__(self, send: Callable[[str, dict[str, Any]], None]) -> None:
        self.send = send
        #: The worker each running collective task was sent to.
        self.running: dict[Key, str] = {}

    def key_transitioned(self, key: Key, finish: str, worker: str | None) -> None:
        """Dask moved ``key`` to ``finish`` (``worker``: where it now runs, for
        ``processing``)."""
        if not (isinstance(key, str) and key.startswith(PREFIXES)):
            return
        if finish == "processing":
            if worker is not None:
                self.running[key] = worker
        elif finish in ("memory", "erred"):
            self.running.pop(key, None)
        elif finish == "forgotten":
            where = self.running.pop(key, None)
            if where is not None:
                logger.info("%r was cancelled while it ran on %s: stopping it", key, where)
                self.send(where, {"op": CANCEL_OP, "key": key})

    def worker_removed(self, worker: str) -> None:
        for key in [k for k, w in self.running.items() if w == worker]:
            del self.running[key]
