"""Read-only questions workers and clients ask the scheduler part.

Reductions and collectives plan with where keys are, how big they are and how
fast the network is, and follow tasks that Dask recomputes or moves. Dask's own
RPCs answer part of that in several round trips; these answer it in one, from
the scheduler's task states and the network model, and change nothing. The
client side of them is :mod:`dask_hoplite.scheduler_calls`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key

from dask_hoplite.core.network_model import NetworkModel

if TYPE_CHECKING:
    from distributed.scheduler import TaskState


class SchedulerQueries:
    """The RPCs ``hoplite_key_states``, ``hoplite_task_worker`` and
    ``hoplite_network``.

    ``task`` looks a key up in the scheduler's task states (``scheduler.tasks.get``).
    """

    def __init__(self, task: Callable[[Key], TaskState | None], network: NetworkModel) -> None:
        self._task = task
        self.network = network

    def key_states(self, keys: list[Key]) -> dict[Key, str | None]:
        """RPC ``hoplite_key_states``: the scheduler's state of each key (None:
        unknown), so a reduction waiting for a lost input can tell a
        recomputation under way from an input that is gone for good."""
        out: dict[Key, str | None] = {}
        for key in keys:
            ts = self._task(key)
            out[key] = None if ts is None else ts.state
        return out

    def task_worker(self, key: Key) -> dict[str, Any]:
        """RPC ``hoplite_task_worker``: the scheduler's state of task ``key``
        and the worker that runs it or holds its result (None: no worker yet,
        or none any more), so a waiter can follow a task Dask moved."""
        ts = self._task(key)
        if ts is None:
            return {"state": None, "worker": None}
        ws = ts.processing_on or next(iter(ts.who_has or ()), None)
        return {"state": ts.state, "worker": None if ws is None else ws.address}

    def network_estimate(self) -> dict[str, Any]:
        """RPC ``hoplite_network``: the bandwidth and latency reduce trees are
        planned with (see :mod:`dask_hoplite.core.network_model`)."""
        return self.network.estimate().to_msg()
