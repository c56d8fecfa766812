"""Cancelled collectives stop: the scheduler part's bookkeeping of where each
collective task runs (pure) and the worker part's running tasks (asyncio).
A whole cancelled reduce tree: tests/test_processes.py."""

from __future__ import annotations

import asyncio

import pytest

from dask_hoplite.core.protocol import CANCEL_OP
from dask_hoplite.errors import CollectiveAborted
from dask_hoplite.scheduler.cancellation import CollectiveCancels
from dask_hoplite.worker.running_tasks import RunningTasks


def cancels():
    sent = []
    return CollectiveCancels(lambda w, msg: sent.append((w, msg))), sent


def test_a_collective_forgotten_while_it_runs_is_stopped_where_it_runs():
    c, sent = cancels()
    key = "hoplite-reduce-sum-abc"
    c.key_transitioned(key, "processing", "tcp://a:1")
    c.key_transitioned(key, "released", None)  # e.g. its plan was lost...
    c.key_transitioned(key, "processing", "tcp://b:1")  # ...and it runs again elsewhere
    c.key_transitioned(key, "forgotten", None)
    assert sent == [("tcp://b:1", {"op": CANCEL_OP, "key": key})]


@pytest.mark.parametrize("end", ["memory", "erred"])
def test_a_finished_collective_or_another_task_is_never_stopped(end):
    c, sent = cancels()
    c.key_transitioned("hoplite-allreduce-sum-abc-0", "processing", "tcp://a:1")
    c.key_transitioned("hoplite-allreduce-sum-abc-0", end, None)
    c.key_transitioned("hoplite-allreduce-sum-abc-0", "forgotten", None)
    c.key_transitioned("inc-123", "processing", "tcp://a:1")
    c.key_transitioned("inc-123", "forgotten", None)
    c.key_transitioned("hoplite-plan-sum-abc", "processing", "tcp://a:1")
    c.worker_removed("tcp://a:1")  # gone with its worker
    c.key_transitioned("hoplite-plan-sum-abc", "forgotten", None)
    assert sent == [] and c.running == {}


def test_a_cancelled_task_fails_as_aborted_and_others_run_on():
    async def main():
        tasks = RunningTasks()
        started = asyncio.Event()

        async def forever():
            started.set()
            await asyncio.sleep(3600)

        async def quick():
            await asyncio.sleep(0.01)
            return 7

        running = asyncio.ensure_future(tasks.run("k", forever()))
        other = asyncio.ensure_future(tasks.run("j", quick()))
        await started.wait()
        tasks.cancel("unknown")  # nothing runs under it: nothing happens
        tasks.cancel("k")
        with pytest.raises(CollectiveAborted, match="'k' was cancelled"):
            await running
        assert await other == 7
        # cancelled by Dask itself (the worker closes): Dask's CancelledError
        again = asyncio.ensure_future(tasks.run("k", forever()))
        await asyncio.sleep(0)
        again.cancel()
        with pytest.raises(asyncio.CancelledError):
            await again
        assert tasks._running == {}

    asyncio.run(main())


def test_a_fetch_cancelled_before_its_first_byte_leaves_no_buffer():
    """A collective task cancelled while it fetches an input for itself (not
    a Dask dependency: no transition of Dask's would ever release it) leaves
    no buffer behind."""
    import numpy as np
    from conftest import three_workers

    from dask_hoplite.compat import worker_addresses

    async def cancel_a_fetch(key, holders, dask_worker):
        receiver = dask_worker.plugins["hoplite-worker"].parts.receiver
        task = asyncio.ensure_future(receiver.fetch_parts([key], {key: holders}))
        for _ in range(3):  # to its first wait: the buffer is announced
            await asyncio.sleep(0)
        announced = key in dask_worker.plugins["hoplite-worker"].store
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return announced, key in dask_worker.plugins["hoplite-worker"].store

    with three_workers() as c:
        ws = worker_addresses(c)
        x = c.submit(np.arange, 2**22, workers=[ws[0]], pure=False)  # 32 MiB
        x.result()
        got = c.run(cancel_a_fetch, x.key, [ws[0]], workers=[ws[1]])[ws[1]]
        assert got == (True, False)
