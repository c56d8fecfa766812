"""Collectives on futures: reduce (every op x dtype x shape x N x k against
numpy, property-based), allreduce, gather, allgather, broadcast, and the errors
users get for bad input."""

from __future__ import annotations

import dataclasses
import time

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses
from dask_hoplite.core.reduce_ops import reference, resolve_op
from dask_hoplite.errors import ReduceInputError


def workers(client):
    return worker_addresses(client)


def scatter(client, arrays):
    ws = workers(client)
    return [client.scatter(a, workers=[ws[i % len(ws)]], hash=False) for i, a in enumerate(arrays)]


def on_inputs_workers(client, outputs, inputs):
    """Output i is on the worker of input i."""
    wait(outputs)
    where = client.who_has(list(outputs) + list(inputs))
    return all(set(where[o.key]) & set(where[i.key]) for o, i in zip(outputs, inputs, strict=True))


def assert_matches(result, expected):
    assert result.shape == expected.shape
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    if expected.dtype.kind in "fc":
        rtol = 1e-2 if expected.dtype.itemsize <= 4 and expected.dtype.kind == "f" else 1e-6
        np.testing.assert_allclose(result, expected, rtol=rtol, atol=1e-3)
    else:
        np.testing.assert_array_equal(result, expected)


DTYPES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "?"]
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3), (40_000,)]
OPS = ["sum", "prod", "min", "max", "mean", np.logaddexp, "bitwise_or"]


@st.composite
def cases(draw):
    op = draw(st.sampled_from(OPS))
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    r = resolve_op(op)
    # skip combinations numpy itself rejects (complex min, logaddexp of ints, ...)
    try:
        r.result_dtype(dtype)
        reference(op, [np.ones(2, dtype), np.ones(2, dtype)])
    except TypeError:
        op, dtype = "sum", dtype
    shape = draw(st.sampled_from(SHAPES))
    n = draw(st.sampled_from([1, 2, 3, 8]))
    k = draw(st.integers(1, n))
    noncontig = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    tree = draw(st.booleans())  # the streaming tree, or one task for small objects
    return op, dtype, shape, n, k, noncontig, seed, tree


def make_inputs(dtype, shape, n, noncontig, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        full_shape = shape + (2,) if noncontig else shape
        a = rng.integers(0, 4, size=full_shape).astype(dtype)
        if dtype.kind == "c":
            a = a + 1j * rng.integers(0, 4, size=full_shape).astype(dtype)
        out.append(a[..., 0] if noncontig else a)
    return out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_reduce_matches_numpy(client, case):
    op, dtype, shape, n, k, noncontig, seed, tree = case
    arrays = make_inputs(dtype, shape, n, noncontig, seed)
    futures = scatter(client, arrays)
    with dask.config.set({"hoplite.min-bytes": 0 if tree else "1 GiB"}):
        total = dh.reduce(futures, op, k=None if k == n else k)
    result = total.result()
    used = dh.reduced_inputs(total)
    assert len(used) == k and len(set(used)) == k
    by_key = {f.key: a for f, a in zip(futures, arrays, strict=True)}
    assert_matches(result, reference(op, [by_key[key] for key in used]))


def test_large_arrays_stream_through_the_tree(client):
    arrays = [np.full(3_000_000, i, dtype="f8") for i in range(8)]  # 24 MB each
    total = dh.reduce(scatter(client, arrays), "sum").result()
    assert total.shape == (3_000_000,) and np.all(total == sum(range(8)))


@pytest.mark.parametrize("min_bytes", [0, "1 GiB"], ids=["tree", "one-task"])
def test_allreduce_gather_allgather_broadcast(client, min_bytes):
    with dask.config.set({"hoplite.min-bytes": min_bytes}):
        _allreduce_gather_allgather_broadcast(client)


def _allreduce_gather_allgather_broadcast(client):
    ws = workers(client)
    arrays = [np.arange(1000) * (i + 1) for i in range(6)]
    futures = scatter(client, arrays)
    parts = dh.allreduce(futures, "max")
    assert len(parts) == len(futures)  # one per input, on its worker
    for p in parts:
        np.testing.assert_array_equal(p.result(), arrays[-1])
    assert on_inputs_workers(client, parts, futures)
    rows = dh.gather(futures, to=ws[0]).result()
    assert all(np.array_equal(a, b) for a, b in zip(rows, arrays, strict=True))
    every = dh.allgather(futures)
    assert len(every) == len(futures)
    for rows in client.gather(every):
        assert all(np.array_equal(a, b) for a, b in zip(rows, arrays, strict=True))
    assert on_inputs_workers(client, every, futures)
    copies = dh.broadcast(futures[0], workers=ws)
    wait(copies)
    assert {tuple(client.who_has(c)[c.key]) for c in copies} == {(w,) for w in ws}
    assert all(np.array_equal(c.result(), arrays[0]) for c in copies)


@pytest.mark.parametrize("min_bytes", [0, "1 GiB"], ids=["tree", "one-task"])
def test_mismatched_inputs_name_the_offender_and_the_cluster_keeps_working(client, min_bytes):
    with dask.config.set({"hoplite.min-bytes": min_bytes}):
        _mismatched(client)


def _mismatched(client):
    good = scatter(client, [np.ones(10), np.ones(10)])
    [bad] = scatter(client, [np.ones(11)])
    with pytest.raises(ReduceInputError, match="has shape .* all inputs of a reduction"):
        dh.reduce(good + [bad], "sum").result()
    [bad_dtype] = scatter(client, [np.ones(10, dtype="f4")])
    with pytest.raises(ReduceInputError, match="dtype"):
        dh.reduce(good + [bad_dtype], "sum").result()
    not_array = client.submit(lambda: "1, 2, 3")
    with pytest.raises(ReduceInputError, match="numpy array"):
        dh.reduce([not_array, not_array], "sum").result()
    # a list of numbers is a pytree (tests/test_pytrees.py): reduced leaf by leaf
    numbers = client.submit(lambda: [1, 2, 3])
    assert dh.reduce([numbers, numbers], "sum").result() == [2, 4, 6]
    # nothing was lost and the next reduction works
    np.testing.assert_array_equal(dh.reduce(good, "sum").result(), np.full(10, 2.0))
    # ...and every partial result was released (asynchronously, right after
    # the parent finished reading it)
    for _ in range(100):
        stores = client.run(lambda dask_worker: len(dask_worker.plugins["hoplite-worker"].store))
        if set(stores.values()) == {0}:
            break
        time.sleep(0.05)
    leftover = client.run(
        lambda dask_worker: repr(dask_worker.plugins["hoplite-worker"].store.buffers)
    )
    assert set(stores.values()) == {0}, leftover


def test_bad_arguments_are_rejected_at_the_call(client):
    futures = scatter(client, [np.ones(3), np.ones(3)])
    with pytest.raises(ValueError, match="op must be"):
        dh.reduce(futures, "median")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, 2\]"):
        dh.reduce(futures, "sum", k=3)
    with pytest.raises(ValueError, match="at least one input"):
        dh.reduce([], "sum")
    with pytest.raises(TypeError, match="input 1 is a list"):
        dh.reduce([futures[0], [1, 2]], "sum")
    with pytest.raises(ValueError, match="not the result of dask_hoplite.reduce"):
        dh.reduced_inputs(futures[0])


def test_delayed_inputs_are_computed_first(client):
    import dask

    parts = [dask.delayed(np.full)(5, i) for i in range(4)]
    np.testing.assert_array_equal(dh.reduce(parts, "sum").result(), np.full(5, 6))


def test_a_single_input_is_not_modified_or_shared(client):
    [f] = scatter(client, [np.arange(6, dtype="f8")])
    with dask.config.set({"hoplite.min-bytes": 0}):  # the tree path: a leaf at the root
        mean = dh.reduce([f], "mean").result()
    np.testing.assert_array_equal(mean, np.arange(6, dtype="f8"))
    np.testing.assert_array_equal(f.result(), np.arange(6, dtype="f8"))


def test_allreduce_copies_stream_while_reducing_and_land_on_every_worker(client):
    ws = workers(client)
    arrays = [np.full(2_000_000, float(i)) for i in range(6)]  # 16 MB each
    futures = scatter(client, arrays)
    parts = dh.allreduce(futures, "mean")
    wait(parts)
    assert {client.who_has(p)[p.key][0] for p in parts} == set(ws)
    assert on_inputs_workers(client, parts, futures)
    for p in parts:
        np.testing.assert_array_equal(p.result(), np.full(2_000_000, 2.5))


@pytest.mark.parametrize("min_bytes", [0, "1 GiB"], ids=["tree", "one-task"])
def test_allreduce_of_mismatched_inputs_fails_everywhere(client, min_bytes):
    futures = scatter(client, [np.ones(10), np.ones(10), np.ones(12)])
    with dask.config.set({"hoplite.min-bytes": min_bytes}):
        parts = dh.allreduce(futures, "sum")
    for p in parts:
        with pytest.raises(Exception):  # noqa: B017 - root: ReduceInputError; copies: aborted
            p.result()
    assert any(isinstance(p.exception(), ReduceInputError) for p in parts)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_allreduce_matches_numpy_on_every_worker(client, case):
    """Every path of allreduce: segmented (one segment per worker, forced here
    for small objects; segments may be empty), one tree plus a chain of
    copies, and the one-task path for small objects."""
    op, dtype, shape, n, _k, noncontig, seed, tree = case
    arrays = make_inputs(dtype, shape, n, noncontig, seed)
    futures = scatter(client, arrays)
    segmented = seed % 2 == 0
    cfg = {
        "hoplite.min-bytes": 0 if tree else "1 GiB",
        "hoplite.reduce.allreduce-segment-min-bytes": 0 if segmented else "1 GiB",
    }
    with dask.config.set(cfg):
        parts = dh.allreduce(futures, op)
    expected = reference(op, arrays)
    holders = {w for f in futures for w in client.who_has(f)[f.key]}
    assert len(parts) == len(futures)
    results = [p.result() for p in parts]
    for r in results:
        assert_matches(r, expected)
        # every worker holds the same value, to the bit (NaNs included)
        assert r.dtype == results[0].dtype and r.tobytes() == results[0].tobytes()
    wait(parts)
    assert holders <= {w for p in parts for w in client.who_has(p)[p.key]}
    assert on_inputs_workers(client, parts, futures)


def test_segmented_allreduce_of_mismatched_inputs_names_the_offender(client):
    futures = scatter(client, [np.ones(10_000), np.ones(10_000), np.ones(10_001)])
    with dask.config.set({"hoplite.min-bytes": 0, "hoplite.reduce.allreduce-segment-min-bytes": 0}):
        parts = dh.allreduce(futures, "sum")
    errors = [p.exception() for p in parts]
    assert all(e is not None for e in errors)
    assert any(isinstance(e, ReduceInputError) and "has shape (10001,)" in str(e) for e in errors)
    # nothing is left behind, and the next allreduce works
    np.testing.assert_array_equal(
        dh.allreduce(futures[:2], "sum")[0].result(), np.full(10_000, 2.0)
    )


def leaked_comms(dask_worker) -> int:
    """Comms a worker's connection pool counts as in use but that are closed:
    each holds one of the pool's 512 slots for good, and once they are all
    gone every connection the worker opens waits forever."""
    return sum(c.closed() for comms in dask_worker.rpc.occupied.values() for c in comms)


def test_broken_trees_give_their_connections_back(client):
    """Reduce trees cut short (an input of another shape: the root's and the
    nodes' streams are aborted) leave every worker's connection pool whole,
    and the workers go on reducing."""
    n = 300_000  # 2.4 MB: above min-bytes, so the inputs take the tree
    for attempt in range(4):
        arrays = [np.ones(n), np.ones(n), np.ones(n + 1 + attempt)]
        with pytest.raises(ReduceInputError, match="shape"):
            dh.reduce(scatter(client, arrays), "sum").result()
    # a leaked slot stays leaked; give comms being torn down right now a moment
    deadline = time.monotonic() + 5
    while set(client.run(leaked_comms).values()) != {0} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(client.run(leaked_comms).values()) == {0}
    total = dh.reduce(scatter(client, [np.ones(n)] * 3), "sum").result()
    assert_matches(total, np.full(n, 3.0))


def set_stall_timeout(dask_worker, seconds):
    p = dask_worker.plugins["hoplite-worker"]
    p.config = dataclasses.replace(p.config, stall_timeout=seconds)


def hoplite_stats(dask_worker):
    return dict(dask_worker.plugins["hoplite-worker"].stats)


def test_small_allreduce_copies_wait_for_a_busy_root(client_without_stealing):
    """The copies of a small allreduce start with the reduction and get its
    result from the root's worker when it exists, even when the root runs
    long after a stall timeout (its worker's only thread is busy): no copy
    gives up and reduces the inputs itself. (Work stealing is off so that the
    root stays behind the busy thread.)"""
    client = client_without_stealing
    ws = workers(client)
    futures = []
    for i, w in enumerate(ws):  # ready in order: the first input's worker is the root's
        futures.append(client.submit(np.full, 10, float(i + 1), workers=[w]))
        wait(futures)
    client.run(set_stall_timeout, seconds=0.3)
    blocker = client.submit(time.sleep, 1.5, workers=[ws[0]], pure=False)
    while client.processing(ws[0])[ws[0]] == ():
        time.sleep(0.01)
    parts = dh.allreduce(futures, "sum")
    results = client.gather(parts)
    assert blocker.done()  # the root ran after the blocker
    assert len(results) == 3
    for r in results:
        np.testing.assert_array_equal(r, np.full(10, 6.0))
    assert list(client.who_has(parts[0])[parts[0].key]) == [ws[0]]
    assert {w for p in parts for w in client.who_has(p)[p.key]} == set(ws)
    stats = client.run(hoplite_stats)
    pulled = sum(s.get("results-pulled", 0) for s in stats.values())
    fallbacks = sum(s.get("allreduce-fallbacks", 0) for s in stats.values())
    assert (pulled, fallbacks) == (2, 0)


@pytest.mark.parametrize("nbytes", [800, 4_000_000])
def test_collectives_work_on_a_cluster_without_the_plugin(nbytes):
    """The same calls on a plain Dask cluster (dask-hoplite not registered):
    Dask's own reduction on one worker, copies by dependency; same results."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        arrays = [np.full(nbytes // 8, i + 1.0) for i in range(4)]
        futures = scatter(c, arrays)
        assert_matches(dh.reduce(futures, "sum").result(), np.sum(arrays, axis=0))
        first3 = dh.reduce(futures, "max", k=3)
        used = [arrays[[f.key for f in futures].index(k)] for k in dh.reduced_inputs(first3)]
        assert len(used) == 3
        assert_matches(first3.result(), np.max(used, axis=0))
        # (new inputs: the reductions above copied the old ones to one worker)
        again = scatter(c, arrays)
        parts = dh.allreduce(again, "mean")
        assert len(parts) == 4  # one per input, on its worker
        for p in c.gather(parts):
            assert_matches(p, np.mean(arrays, axis=0))
        assert on_inputs_workers(c, parts, again)
        every = dh.allgather(again)
        assert [[a.sum() for a in rows] for rows in c.gather(every)] == [
            [a.sum() for a in arrays]
        ] * 4
        copies = dh.broadcast(again[0], workers=workers(c), parts=2)
        assert [x.sum() for x in c.gather(copies)] == [arrays[0].sum()] * 3
        assert [a.sum() for a in dh.gather(futures, to=workers(c)[1]).result()] == [
            a.sum() for a in arrays
        ]
        assert "hoplite_info" not in c.run_on_scheduler(
            lambda dask_scheduler: dask_scheduler.handlers
        )


def _slow_array(i, seconds):
    time.sleep(seconds)
    return np.full(1000, float(i))


def test_reduce_returns_at_once_and_chooses_the_first_k_on_the_cluster(client):
    """dh.reduce on inputs that take 5 s returns a Future at once, like
    client.submit; the result and reduced_inputs are right."""
    futures = [client.submit(_slow_array, i, 5, pure=False) for i in range(4)]
    total = dh.reduce(futures, "sum", k=3)
    # Returned before any input was ready (each takes 5 s): nothing waited.
    assert not any(f.done() for f in futures)
    assert total.status == "pending"
    used = dh.reduced_inputs(total)
    assert len(set(used)) == 3 and set(used) <= {f.key for f in futures}
    values = {f.key: float(i) for i, f in enumerate(futures)}
    np.testing.assert_array_equal(total.result(), np.full(1000, sum(values[k] for k in used)))


def test_a_reduction_on_one_thread_does_not_wait_on_itself():
    """One worker with one thread, inputs that become ready only after the
    reduction's planning task (and rank below it): the planning task waits
    for them without holding the only thread, so they run and the reduction
    finishes (it used to hang: Dask counts a running coroutine task against
    the worker's threads)."""
    with (
        LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        c.register_plugin(dh.Hoplite())
        gate = c.submit(time.sleep, 0.5, pure=False)  # keeps the thread busy meanwhile
        futures = [
            c.submit(lambda _, i: np.full(1000, float(i)), gate, i, priority=-10, pure=False)
            for i in range(3)
        ]
        total = dh.reduce(futures, "sum")
        np.testing.assert_array_equal(total.result(timeout=30), np.full(1000, 3.0))


def test_a_reduction_over_a_failed_input_names_it(client):
    def bad():
        raise ZeroDivisionError("boom")

    good = scatter(client, [np.ones(10), np.ones(10)])
    failing = client.submit(bad, pure=False)
    total = dh.reduce(good + [failing], "sum")  # returns at once, fails on the cluster
    with pytest.raises(Exception, match=f"input '{failing.key}' of the reduction failed"):
        total.result()
    # with k=2 the failed input is simply not chosen
    np.testing.assert_array_equal(
        dh.reduce(good + [failing], "sum", k=2).result(), np.full(10, 2.0)
    )


def _slow_big(i, seconds):
    time.sleep(seconds)
    return np.full(2**21, float(i))  # 16 MiB: a reduce tree


def test_a_reduction_future_is_an_ordinary_future(client):
    """Passed to a task, it is the reduction; cancelled while its inputs are
    still computing, it leaves no hoplite buffer or directory entry behind,
    and the same inputs reduce again afterwards."""
    futures = [client.submit(_slow_big, i, 1.0, pure=False) for i in range(3)]
    total = dh.reduce(futures, "sum")
    assert client.submit(lambda x: float(x[0]), total).result() == 3.0
    again = dh.reduce(futures, "max")
    again.cancel()
    assert again.cancelled()
    del again, total
    np.testing.assert_array_equal(dh.reduce(futures, "min").result()[:4], np.zeros(4))
    late = [client.submit(_slow_big, i, 1.0, pure=False) for i in range(3)]
    cancelled = dh.reduce(late, "sum")
    cancelled.cancel()
    del futures, late, cancelled
    deadline = time.monotonic() + 30
    while True:
        entries = client.run_on_scheduler(
            lambda dask_scheduler: len(dask_scheduler.plugins["hoplite"].directory)
        )
        buffers = client.run(lambda dask_worker: len(dask_worker.plugins["hoplite-worker"].store))
        if entries == 0 and not any(buffers.values()):
            break
        assert time.monotonic() < deadline, f"left: {entries} entries, buffers {buffers}"
        time.sleep(0.1)


@pytest.mark.parametrize("size", [1000, 2**21])  # one task, a reduce tree
def test_reduce_to_puts_the_result_on_that_worker(client, size):
    ws = workers(client)
    inputs = [np.full(size, float(i)) for i in range(4)]
    futures = [client.scatter(x, workers=[ws[i % 2]]) for i, x in enumerate(inputs)]
    for to in (ws[1], ws[2]):  # holds inputs; holds none
        total = dh.reduce(futures, "sum", to=to)
        np.testing.assert_array_equal(total.result(), np.full(size, 6.0))
        assert client.who_has([total])[total.key] == (to,)


def test_reduce_to_an_unknown_worker_says_so(client):
    futures = scatter(client, [np.ones(10), np.ones(10)])
    with pytest.raises(ValueError, match="to='tcp://nowhere:1' is not a worker"):
        dh.reduce(futures, to="tcp://nowhere:1").result()
    with pytest.raises(TypeError, match="to must be a worker address"):
        dh.reduce(futures, to=3)
    np.testing.assert_array_equal(dh.reduce(futures).result(), np.full(10, 2.0))


def _two_plans(client, rid):
    """Two plans of one reduction request of 3 inputs of 16 MiB (a reduce
    tree), rooted on the first and the second worker, the second's inputs in
    another order (its tree differs); with the input futures (keep them)."""
    from dask_hoplite.config import HopliteConfig
    from dask_hoplite.core.reduce_plan import PlanRequest
    from dask_hoplite.worker import tasks

    ws = workers(client)
    inputs = [np.full(2**21, float(i + 1)) for i in range(3)]
    futures = [client.scatter(x, workers=[w]) for x, w in zip(inputs, ws, strict=True)]
    cfg = HopliteConfig.from_dask_config()
    req = PlanRequest(
        rid=rid,
        op="sum",
        inputs=tuple(f.key for f in futures),
        k=3,
        min_bytes=cfg.min_bytes,
        block_bytes=cfg.block_bytes,
    )
    again = dataclasses.replace(req, inputs=req.inputs[::-1], to=ws[1])
    plans = [
        client.submit(tasks.plan_reduce, r, pure=False).result()
        for r in (dataclasses.replace(req, to=ws[0]), again)
    ]
    assert plans[0]["type"] == plans[1]["type"] == "tree"
    return plans, futures


def test_a_reduction_planned_twice_and_run_at_once_never_mixes(client):
    """Two computations of one reduction's plan are two runs, numbered in
    order. Run at once (as a result task Dask starts again while the first
    execution's root, on a worker it removed, goes on), the run started last
    supersedes the other: each gives the right result or is refused as
    stale, at least one gives it, and they never share partial results."""
    from dask_hoplite.errors import StaleRun
    from dask_hoplite.worker import tasks

    plans, _ = _two_plans(client, "twice")
    assert plans[0]["rid"] != plans[1]["rid"]
    runs = [
        client.submit(tasks.run_reduce, p, workers=[to], pure=False)
        for p, to in zip(plans, workers(client)[:2], strict=True)
    ]
    right = 0
    for r in runs:
        try:
            np.testing.assert_array_equal(r.result(timeout=60), np.full(2**21, 6.0))
            right += 1
        except StaleRun as e:
            assert "is stale" in str(e), e
    assert right >= 1


def test_a_replayed_message_of_an_earlier_run_is_refused_and_the_cluster_goes_on(client, caplog):
    """Once a later run of a request has run, a node message of the earlier
    run sent to a worker of the later one is refused with a clear error
    naming it (and logged there): nothing of it starts and no partial result
    of it stays. A result task Dask starts again with the earlier plan is
    the live execution: it runs as a new run, right."""
    from dask_hoplite.worker import tasks

    plans, futures = _two_plans(client, "replayed")
    later = plans[1]["spec"]
    root = later["addresses"][later["parent"].index(None)]
    later_run = client.submit(tasks.run_reduce, plans[1], workers=[root], pure=False)
    np.testing.assert_array_equal(later_run.result(timeout=60), np.full(2**21, 6.0))

    earlier = plans[0]["spec"]
    first_root = earlier["addresses"][earlier["parent"].index(None)]
    node = next(i for i, a in enumerate(earlier["addresses"]) if a != first_root)

    async def send_node(dask_worker):
        return await dask_worker.rpc(earlier["addresses"][node]).hoplite_reduce_node(
            spec=earlier, slot=node
        )

    with caplog.at_level("WARNING", logger="dask_hoplite.worker.reductions"):
        reply = client.run(send_node, workers=[first_root])[first_root]
    assert reply["status"] == "error" and reply.get("stale"), reply
    assert f"{earlier['rid']} is stale" in reply["message"]
    assert any(earlier["rid"] in r.getMessage() for r in caplog.records), caplog.text

    def partials_of(rid, dask_worker):
        store = dask_worker.plugins["hoplite-worker"].parts.ctx.store
        return [k for k in store.buffers if isinstance(k, tuple) and rid in k]

    held = client.run(partials_of, earlier["rid"])
    assert not any(held.values()), held

    again = client.submit(tasks.run_reduce, plans[0], workers=[first_root], pure=False)
    np.testing.assert_array_equal(again.result(timeout=60), np.full(2**21, 6.0))
    assert_matches(dh.reduce(futures, op="sum").result(timeout=60), np.full(2**21, 6.0))
