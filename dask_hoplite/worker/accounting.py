"""Hoplite's transfers in Dask's own bookkeeping.

Dask records each of its fetches on both ends; the dashboard, the Task
Stream, ``Worker.bandwidth`` (and through the heartbeat the scheduler's
transfer-cost estimates) and the fine performance metrics all read those
records. Bytes that hoplite streams must land in the same places, or Dask's
tools go blind exactly where hoplite takes over:

* the receiving worker: an entry in ``transfer_incoming_log``; for a key Dask
  tracks on it, also a ``"transfer"`` entry with the sender as ``source`` in
  the ``startstops`` of the task that needs the key (drawn by the Task Stream),
  the bandwidth estimates and the ``transfer-*`` digests, all by Dask's own
  ``Worker._update_metrics_received_data``;
* the sending worker: ``transfer_outgoing_count``/``_bytes`` while the stream
  runs, their ``_total`` counters and an entry in ``transfer_outgoing_log``,
  as ``Worker.get_data`` keeps them;
* the fine performance metrics: the stream's time is metered as ``"network"``
  and (de)serialisation as Dask meters it, under the activity Dask uses
  (``gather-dep`` when the fetch serves ``Worker.gather_dep``, ``get-data``
  on the sender).

Sizes are Dask's estimate of the key where it has one (``TaskState.nbytes``,
what Dask's own records hold) and the bytes on the wire otherwise (a reduce
tree's partial results, which Dask never sees). Each log entry hoplite adds
also has ``"hoplite": True``, so that hoplite's transfers and Dask's own can
be told apart.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Coroutine, Hashable, Iterator
from functools import wraps
from typing import Any, TypeVar

from dask.typing import Key
from distributed.metrics import context_meter, time
from distributed.worker import Worker

logger = logging.getLogger(__name__)

#: Dask's bandwidth estimates ignore transfers of this many bytes or fewer
#: (``Worker._update_metrics_received_data``): latency dominates them.
_BANDWIDTH_MIN_BYTES = 1_000_000

T = TypeVar("T")


def _log_entry(
    worker: Worker, key: Key, who: str | None, start: float, stop: float, nbytes: int
) -> dict[str, Any]:
    """A transfer-log entry as Dask writes them (times on the scheduler's
    clock), marked as hoplite's."""
    delay = worker.scheduler_delay
    duration = max(0.001, stop - start)
    return {
        "start": start + delay,
        "stop": stop + delay,
        "middle": (start + stop) / 2 + delay,
        "duration": duration,
        "who": who,
        "keys": {key: nbytes},
        "total": nbytes,
        "bandwidth": nbytes / duration,
        "hoplite": True,
    }


def received(
    worker: Worker,
    key: Key,
    sender: str,
    start: float,
    stop: float,
    nbytes: int,
    value: Any = None,
) -> None:
    """Record on ``worker`` that ``key`` arrived from ``sender`` between
    ``start`` and ``stop`` (``distributed.metrics.time()``), ``nbytes`` on the
    wire; ``value``: the object, for Dask's per-type bandwidth."""
    ts = worker.state.tasks.get(key)
    if ts is not None and ts.nbytes is not None:
        # A key Dask tracks here: exactly what Dask records for its own fetch.
        cause = worker._get_cause([key])
        worker._update_metrics_received_data(
            start=start, stop=stop, data={key: value}, cause=cause, worker=sender
        )
        worker.transfer_incoming_log[-1]["hoplite"] = True
        return
    # A key Dask does not track here (a task's own fetch, a reduce tree's
    # partial result): the log, the bandwidth and the digests, no startstops.
    entry = _log_entry(worker, key, sender, start, stop, nbytes)
    worker.transfer_incoming_log.append(entry)
    bandwidth, duration = entry["bandwidth"], entry["duration"]
    if nbytes > _BANDWIDTH_MIN_BYTES:
        worker.bandwidth = worker.bandwidth * 0.95 + bandwidth * 0.05
        bw, cnt = worker.bandwidth_workers[sender]
        worker.bandwidth_workers[sender] = (bw + bandwidth, cnt + 1)
    worker.digest_metric("transfer-bandwidth", bandwidth)
    worker.digest_metric("transfer-duration", duration)
    worker.counters["transfer-count"].add(1)


@contextlib.contextmanager
def sending(
    worker: Worker, key: Key, who: str | None, nbytes: int, counted: bool = True
) -> Iterator[list[int]]:
    """While a stream of ``nbytes`` bytes of ``key`` to ``who`` runs: count it
    in ``worker``'s open outgoing transfers and their totals, as
    ``Worker.get_data`` does, and log it when it ends. The caller puts the
    bytes actually sent in the yielded one-item list: a stream that broke is
    logged with what it sent. Not ``counted``: the accounting is off
    (:mod:`dask_hoplite.features`), nothing is recorded."""
    if not counted:
        yield [0]
        return
    worker.transfer_outgoing_count += 1
    worker.transfer_outgoing_count_total += 1
    worker.transfer_outgoing_bytes += nbytes
    worker.transfer_outgoing_bytes_total += nbytes
    sent = [0]
    start = time()
    try:
        with context_meter.meter("network", func=time):
            yield sent
    finally:
        stop = time()
        worker.transfer_outgoing_bytes -= nbytes
        worker.transfer_outgoing_count -= 1
        if sent[0] < nbytes:  # the total counts what was sent
            worker.transfer_outgoing_bytes_total -= nbytes - sent[0]
        entry = _log_entry(worker, key, who, start, stop, sent[0])
        worker.transfer_outgoing_log.append({**entry, "compressed": 0})


def metered_as(
    tag: str,
) -> Callable[
    [Callable[..., Coroutine[Any, Any, T]]],
    Callable[..., Coroutine[Any, Any, T]],
]:
    """Decorate a worker-part coroutine method whose object has ``ctx.worker``:
    the ``context_meter`` calls made while it runs reach the worker's fine
    performance metrics as ``(tag, label, unit)``, as Dask's
    ``context_meter_to_server_digest`` does for ``Worker.get_data``."""

    def decorator(
        func: Callable[..., Coroutine[Any, Any, T]],
    ) -> Callable[..., Coroutine[Any, Any, T]]:
        @wraps(func)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
            worker: Worker = self.ctx.worker
            if not self.ctx.accounting:
                return await func(self, *args, **kwargs)

            def digest(label: Hashable, value: float, unit: str) -> None:
                labels = label if isinstance(label, tuple) else (label,)
                worker.digest_metric((tag, *labels, unit), value)

            with context_meter.add_callback(digest, allow_offload=True):
                return await func(self, *args, **kwargs)

        return wrapper

    return decorator
