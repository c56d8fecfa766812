"""What workers and clients ask the scheduler part, beyond Dask's own RPCs.

Outside :mod:`dask_hoplite.scheduler`: workers and clients call it, and the
scheduler part takes only the names of its metadata entries from here, and
the wait for holders (its reduction coordinator runs it over the scheduler's
own task states). The scheduler's side of each call is in that package (the
reduction coordinator, the queries, the first-ready wait).

Thin coroutines over an RPC handle to the scheduler (``worker.scheduler`` or
``client.scheduler``), each returning plain data or raising an error named
after the input: a reduction's plan and a broken tree's new run from the
scheduler's reduction coordinator, the error of an input that cannot come
back, and a wait for the holders of keys that Dask is recomputing from their
lineage.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from dask.typing import Key
from distributed import KilledWorker
from distributed.protocol import pickle
from distributed.protocol.serialize import Serialized, deserialize

from dask_hoplite.core.reduce_plan import PlanRequest
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.errors import ReduceInputLost, StaleRun

#: The scheduler's metadata entry that holds the running scheduler part's
#: version while the collectives run on every worker (None or absent:
#: dask-hoplite is not registered, or some worker runs without its
#: collectives, e.g. a mixed cluster; see ``Hoplite._publish``).
METADATA_KEY = "dask-hoplite"
#: The scheduler's metadata entry that holds the scheduler part's version
#: while it is installed, whatever the workers run: its records (e.g. which
#: spares a reduction used) can be asked then, even while a restarted worker
#: has not yet reported its part and :data:`METADATA_KEY` says None.
SCHEDULER_PART_KEY = "dask-hoplite-scheduler"


def raise_if_gone_for_good(states: dict[Key, str | None]) -> None:
    """Raise if a lost input cannot come back: the scheduler's state of it is
    erred, forgotten or unknown (anything else is a recomputation under way)."""
    for key, state in states.items():
        if state in (None, "erred", "forgotten"):
            raise ReduceInputLost(
                f"input {key!r} of the reduction was lost and cannot be recomputed "
                f"(scheduler state: {state or 'unknown'})"
            )


async def wait_for_holders(
    scheduler: Any,
    keys: list[Key],
    usable: Callable[[Key, list[str]], bool],
    *,
    queue_timeout: float,
    poll: float,
) -> dict[Key, list[str]]:
    """The scheduler's ``who_has`` of ``keys`` as soon as every key has holders
    that ``usable(key, holders)`` accepts.

    A key without usable holders is typically lost and being recomputed by
    Dask from its lineage (waiting, queued, processing...): wait for it, as
    long as its scheduler state keeps changing within ``queue_timeout``. A
    key that cannot come back (erred, forgotten, unknown) raises at once; one
    whose state stays the same for ``queue_timeout`` raises too, naming it."""
    deadline = time.monotonic() + queue_timeout
    last: dict[Key, str | None] = {}
    while True:
        who_has = await scheduler.who_has(keys=keys)
        pending = [k for k in keys if not usable(k, sorted(who_has.get(k) or ()))]
        if not pending:
            return {k: sorted(who_has.get(k) or ()) for k in keys}
        states = await scheduler.hoplite_key_states(keys=pending)
        raise_if_gone_for_good({k: states.get(k) for k in pending})
        if states != last:
            last, deadline = states, time.monotonic() + queue_timeout
        elif time.monotonic() > deadline:
            key = pending[0]
            raise ReduceInputLost(
                f"input {key!r} of the reduction has no usable holder "
                f"(holders {sorted(who_has.get(key) or ())}, scheduler state "
                f"{states.get(key)!r}) and nothing changed for {queue_timeout:g}s"
            )
        await asyncio.sleep(poll)


async def request_plan(
    scheduler: Any,
    req: PlanRequest,
    who_has: dict[Key, list[str]] | None = None,
    nbytes: dict[Key, int] | None = None,
) -> dict[str, Any]:
    """The scheduler's answer to ``hoplite_plan_reduction`` for ``req``
    (:class:`~dask_hoplite.scheduler.reduction_coordinator.ReductionCoordinator`):
    ``{"plan": ...}``, and an allreduce's output roles. Raises
    :class:`ValueError` for a ``to`` that is no worker, and the error of an
    input that cannot come back."""
    kwargs: dict[str, Any] = {"request": req.to_msg()}
    if who_has is not None:
        kwargs.update(who_has=who_has, nbytes=nbytes)
    answer: dict[str, Any] = await scheduler.hoplite_plan_reduction(**kwargs)
    if "error" in answer:
        raise ValueError(answer["error"])
    if "failed" in answer:
        await raise_lost(answer["failed"], answer["state"], answer.get("exception"))
    return answer


async def replan_tree(
    scheduler: Any,
    spec: ReduceSpec,
    root: str,
    avoid: set[str],
    *,
    queue_timeout: float,
    stall_timeout: float,
    supersede: bool = False,
) -> tuple[ReduceSpec, dict[Key, Key]]:
    """Tree ``spec`` as a new run rooted on ``root``, with every input where
    it is now, and the lost inputs spares replaced (lost -> spare), from the
    scheduler's reduction coordinator (``hoplite_replan_tree``). Raises
    :class:`ReduceInputLost` for an input that cannot come back,
    :class:`StaleRun` for a run that a later one superseded (not with
    ``supersede``: the coordinator's ``replan_tree``)."""
    answer = await scheduler.hoplite_replan_tree(
        spec=spec.to_msg(),
        root=root,
        avoid=sorted(avoid),
        queue_timeout=queue_timeout,
        stall_timeout=stall_timeout,
        supersede=supersede,
    )
    if "failed" in answer:
        raise ReduceInputLost(answer["failed"])
    if "stale" in answer:
        raise StaleRun(answer["stale"])
    return ReduceSpec.from_msg(answer["spec"]), {lost: spare for lost, spare in answer["swaps"]}


def _exception(value: Any) -> BaseException | None:
    """An erred task's exception as the scheduler keeps it (serialized)."""
    if isinstance(value, Serialized):
        value = deserialize(value.header, value.frames)
    if isinstance(value, bytes):
        value = pickle.loads(value)
    return value if isinstance(value, BaseException) else None


async def raise_lost(key: Key, state: str | None, exception: Any) -> None:
    """Raise the error of input ``key`` that cannot come back (``exception``:
    its task's, as the scheduler keeps it, or None): Dask's KilledWorker as
    it is, any other error named after the input."""
    error = _exception(exception)
    if isinstance(error, KilledWorker):
        raise error
    if state == "erred":
        raise ReduceInputLost(
            f"input {key!r} of the reduction failed: {error!r}"
            if error is not None
            else f"input {key!r} of the reduction failed (its future holds the error)"
        ) from error
    raise ReduceInputLost(
        f"input {key!r} of the reduction is gone and cannot be recomputed "
        f"(scheduler state: {state or 'unknown'}); was it cancelled or released?"
    )
