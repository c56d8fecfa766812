"""Tasks needing a large key spread to idle workers at once
(``hoplite.stealing.prompt``), not at work stealing's next tick."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from distributed import get_worker, wait
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.core.measured_sizes import MeasuredSizes
from dask_hoplite.scheduler.prompt_stealing import PromptStealing

SMALL = {
    "hoplite.min-bytes": "64 KiB",
    "hoplite.min-block-bytes": "4 KiB",
    # Dask's own stealing round never comes within the test: whatever
    # spreads the tasks is the prompt round.
    "distributed.scheduler.work-stealing-interval": "1h",
    "distributed.scheduler.default-task-durations": {"hold": "1s"},
}


def hold(x, i):
    """A task of about half a second that needs ``x``; says where it ran."""
    time.sleep(0.5)
    return get_worker().address, float(x[0]) + i


async def _where_tasks_ran(c, a, n_tasks, nbytes):
    await c.register_plugin(Hoplite())
    x = c.submit(np.ones, nbytes // 8, workers=[a.address], pure=False)
    await wait(x)
    futures = [c.submit(hold, x, i, key=f"hold-{i}") for i in range(n_tasks)]
    results = await c.gather(futures)
    assert [v for _, v in results] == [1.0 + i for i in range(n_tasks)]
    return {w for w, _ in results}


def _steals(s) -> str:
    """What Dask's stealing logged (requests, confirmations, refusals), for a
    failed assertion to show."""
    moves = s.plugins["hoplite"].prompt_stealing.moves
    events = "\n".join(repr(ev) for _, ev in s.get_events("stealing"))
    return f"{moves} prompt moves; Dask's stealing log:\n{events}"


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_tasks_needing_a_large_key_spread_to_idle_workers_at_once(c, s, a, b, d):
    """Dask places all six on x's only holder; the idle workers get theirs
    without waiting for work stealing's tick (an hour here)."""
    where = await _where_tasks_ran(c, a, 6, 1 << 20)
    assert where == {a.address, b.address, d.address}, _steals(s)
    assert s.plugins["hoplite"].prompt_stealing.moves >= 1


@gen_cluster(
    client=True, nthreads=[("", 1)] * 3, config={**SMALL, "hoplite.stealing.prompt": False}
)
async def test_without_prompt_stealing_they_wait_for_dasks_tick(c, s, a, b, d):
    """The counterpart: the same tasks all run on x's holder."""
    assert await _where_tasks_ran(c, a, 6, 1 << 20) == {a.address}
    assert s.plugins["hoplite"].prompt_stealing is None


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_tasks_needing_only_small_keys_keep_dasks_cadence(c, s, a, b, d):
    """x under min-bytes: Dask's placement and tick, untouched."""
    assert await _where_tasks_ran(c, a, 6, 8 << 10) == {a.address}
    assert s.plugins["hoplite"].prompt_stealing.moves == 0


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_restricted_tasks_keep_dasks_cadence(c, s, a, b, d):
    """Loosely restricted to x's holder (as hoplite's collectives place their
    outputs): the prompt round leaves them where they were put."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.ones, 1 << 17, workers=[a.address], pure=False)
    futures = [
        c.submit(hold, x, i, key=f"hold-{i}", workers=[a.address], allow_other_workers=True)
        for i in range(6)
    ]
    assert {w for w, _ in await c.gather(futures)} == {a.address}
    assert s.plugins["hoplite"].prompt_stealing.moves == 0


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 3,
    config={**SMALL, "distributed.scheduler.work-stealing": False},
)
async def test_with_work_stealing_off_nothing_moves(c, s, a, b, d):
    assert await _where_tasks_ran(c, a, 4, 1 << 20) == {a.address}
    assert s.plugins["hoplite"].prompt_stealing is None


# ------------------------------------------------- the rule, without a cluster


class Loop:
    """The timer PromptStealing is given: records, runs on demand."""

    def __init__(self):
        self.pending = []

    def call_later(self, delay, fn):
        self.pending.append((delay, fn))

    def run(self):
        pending, self.pending = self.pending, []
        for _, fn in pending:
            fn()


class Worker:
    """A worker of one thread, hashable by identity as Dask's WorkerState."""

    def __init__(self, name):
        self.name, self.processing, self.nthreads = name, [], 1


class Cluster:
    """What PromptStealing reads of the scheduler (DaskStealing's methods),
    as plain data: workers of one thread, tasks of ``duration`` seconds each
    needing x (of ``x_bytes``, held by w0) at 100 MB/s."""

    def __init__(self, n_workers, x_bytes, duration=1.0):
        self.workers = [Worker(f"w{i}") for i in range(n_workers)]
        self.x = SimpleNamespace(key="x", nbytes=x_bytes, holder=self.workers[0])
        self.tasks = {}
        self.duration_ = duration
        self.moved = []

    def submit(self, key, ws, restricted=False):
        ts = SimpleNamespace(
            key=key,
            dependencies=[self.x],
            processing_on=ws,
            priority=(len(self.tasks),),
            worker_restrictions={ws.name} if restricted else None,
            host_restrictions=None,
            resource_restrictions=None,
        )
        self.tasks[key] = ts
        ws.processing.append(ts)
        return ts

    def finish(self, key):
        ts = self.tasks.pop(key)
        ts.processing_on.processing.remove(ts)
        ts.processing_on = None

    # DaskStealing's interface
    def task(self, key):
        return self.tasks.get(key)

    def idle(self):
        return [ws for ws in self.workers if not ws.processing]

    def nprocessing(self, ws):
        return len(ws.processing)

    def occupancy(self, ws):
        return self.duration_ * len(ws.processing)

    def moving(self, ts):
        return False

    def duration(self, ts):
        return self.duration_

    def comm_cost(self, ts, ws):
        return 0.0 if ws is self.x.holder else self.x.nbytes / 100e6

    def move(self, ts, victim, thief):
        self.moved.append((ts.key, victim.name, thief.name))
        victim.processing.remove(ts)
        thief.processing.append(ts)
        ts.processing_on = thief


def _prompt(cluster, loop):
    return PromptStealing(cluster, loop.call_later, MeasuredSizes(), min_bytes=64 << 10, delay=0.05)


def test_one_round_moves_one_task_to_each_idle_worker():
    cluster, loop = Cluster(3, 1 << 20), Loop()
    ps = _prompt(cluster, loop)
    w0 = cluster.workers[0]
    for i in range(6):
        cluster.submit(f"t{i}", w0)
        ps.key_transitioned(f"t{i}", "waiting", "processing")
    assert len(loop.pending) == 1  # a burst makes one round
    loop.run()
    # the last two in priority order (the least likely to have started)
    assert sorted(cluster.moved) == [("t4", "w0", "w2"), ("t5", "w0", "w1")] or sorted(
        cluster.moved
    ) == [("t4", "w0", "w1"), ("t5", "w0", "w2")]
    assert ps.moves == 2


@pytest.mark.parametrize(
    "x_bytes, n_tasks, n_workers, restricted, moves",
    [
        (1 << 20, 6, 3, False, 2),
        (1 << 10, 6, 3, False, 0),  # small dependency: Dask's cadence
        (1 << 20, 6, 3, True, 0),  # restricted: where it was put
        (1 << 20, 1, 3, False, 0),  # nothing queued
        (1 << 20, 6, 1, False, 0),  # nobody idle
        (1 << 30, 6, 3, False, 0),  # x takes 10 s to move: waiting is cheaper
    ],
)
def test_what_moves(x_bytes, n_tasks, n_workers, restricted, moves):
    cluster, loop = Cluster(n_workers, x_bytes), Loop()
    ps = _prompt(cluster, loop)
    for i in range(n_tasks):
        cluster.submit(f"t{i}", cluster.workers[0], restricted)
        ps.key_transitioned(f"t{i}", "waiting", "processing")
    loop.run()
    assert ps.moves == len(cluster.moved) == moves


def test_a_freed_thread_starts_a_round_while_a_large_keys_task_is_queued():
    cluster, loop = Cluster(2, 1 << 20), Loop()
    ps = _prompt(cluster, loop)
    w0, w1 = cluster.workers
    for i, ws in enumerate((w0, w0, w1, w1, w1)):
        cluster.submit(f"t{i}", ws)
        ps.key_transitioned(f"t{i}", "waiting", "processing")
    loop.run()
    assert cluster.moved == []  # nobody idle
    for key in ("t0", "t1"):  # w0's two end
        cluster.finish(key)
        ps.key_transitioned(key, "processing", "memory")
    loop.run()
    assert cluster.moved == [("t4", "w1", "w0")]
    for key in ("t2", "t3", "t4"):
        cluster.finish(key)
        ps.key_transitioned(key, "processing", "memory")
    assert not ps.queued
    loop.run()
    assert len(cluster.moved) == 1


def test_a_task_the_worker_already_started_is_not_asked_for_again():
    """Dask refuses to steal a task its worker has started (the worker may run
    tasks in another order than their priority): the task stays there. The
    next round asks for another one, not the refused one again."""
    cluster, loop = Cluster(2, 1 << 20), Loop()
    ps = _prompt(cluster, loop)
    w0, _ = cluster.workers
    for i in range(4):
        cluster.submit(f"t{i}", w0)
        ps.key_transitioned(f"t{i}", "waiting", "processing")
    refused = []
    move = cluster.move

    def refuse_t3(ts, victim, thief):
        if ts.key == "t3":
            refused.append(ts.key)  # already computing: it stays on w0
        else:
            move(ts, victim, thief)

    cluster.move = refuse_t3
    loop.run()
    assert refused == ["t3"] and cluster.moved == []
    cluster.finish("t0")  # a thread frees on w0: another round
    ps.key_transitioned("t0", "processing", "memory")
    loop.run()
    assert refused == ["t3"] and cluster.moved == [("t2", "w0", "w1")]
