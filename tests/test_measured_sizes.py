"""Objects whose ``sizeof`` is wrong travel by the bytes they really are.

Dask sizes an object of a type it has no rule for with ``sys.getsizeof``: a
class wrapping a large buffer reports some 50 bytes. The worker that computes
such a result measures it serialised; a large one then reaches its consumers
through hoplite, serialised once, while small ones stay on Dask's path."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from dask.sizeof import sizeof
from distributed import wait
from distributed.utils_test import gen_cluster
from hypothesis import given
from hypothesis import strategies as st

from dask_hoplite import Hoplite
from dask_hoplite.core.measured_sizes import MeasuredSizes, sizeof_may_be_wrong

SMALL = {
    "hoplite.min-bytes": "64 KiB",
    "hoplite.min-block-bytes": "4 KiB",
    "hoplite.block-bytes": "64 KiB",
    "hoplite.window-bytes": "256 KiB",
}
PAYLOAD = 512 * 1024


class Wrapped:
    """A Python object around a buffer, as a C library's model is: Dask's
    ``sizeof`` sees only the wrapper. Counts how often it is serialised."""

    serialised = 0

    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def __reduce__(self) -> tuple[Any, ...]:
        Wrapped.serialised += 1
        return (Wrapped, (self.payload,))


def make(n: int, seed: int = 0) -> Wrapped:
    return Wrapped(np.random.default_rng(seed).bytes(n))


def digest(w: Wrapped, i: int = 0) -> str:
    return hashlib.sha256(w.payload).hexdigest()


def expected(n: int, seed: int = 0) -> str:
    return hashlib.sha256(np.random.default_rng(seed).bytes(n)).hexdigest()


def hoplite_entries(worker, key) -> list[bool]:
    """For each transfer-log entry of ``worker`` that brought ``key``: hoplite's?"""
    return [bool(e.get("hoplite")) for e in worker.transfer_incoming_log if key in e["keys"]]


# ------------------------------------------------------------------ the core


def test_dask_sizes_a_wrapper_of_a_buffer_as_the_wrapper_alone():
    """The premise: without a rule for the type, Dask counts the wrapper."""
    assert sizeof(make(PAYLOAD)) < 1000


@pytest.mark.parametrize(
    "value, suspect",
    [
        (Wrapped(b"x"), True),
        ([Wrapped(b"x"), Wrapped(b"y")], True),
        ({"model": Wrapped(b"x")}, True),
        ((1, [Wrapped(b"x")]), True),
        (np.zeros(10), False),
        (b"x" * 100, False),
        ("text", False),
        (12345, False),
        (None, False),
        ([1, 2.0, "three"], False),
        ({"a": np.zeros(3)}, False),
        ([[[Wrapped(b"deep")]]], False),  # deeper than Dask's sample looks
    ],
)
def test_which_objects_dask_may_size_wrong(value, suspect):
    assert sizeof_may_be_wrong(value) is suspect


def test_measured_sizes_plan_with_the_larger_and_tell_each_worker_once():
    sizes = MeasuredSizes()
    assert sizes.size("x", 56) == 56
    sizes.measured("x", 10_000_000)
    assert sizes.size("x", 56) == 10_000_000
    assert sizes.size("x", 20_000_000) == 20_000_000  # Dask's estimate, where larger
    assert sizes.consumer_placed("w1", ["x", "y"]) == {"x": 10_000_000}
    assert sizes.consumer_placed("w1", ["x"]) == {}  # told already
    assert sizes.consumer_placed("w2", ["x"]) == {"x": 10_000_000}
    sizes.worker_removed("w2")
    assert sizes.consumer_placed("w2", ["x"]) == {"x": 10_000_000}  # a new worker there
    sizes.forget("x")
    assert sizes.size("x", 56) == 56 and len(sizes) == 0
    assert sizes.consumer_placed("w3", ["x"]) == {}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["measure", "forget", "place", "remove"]),
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(["w1", "w2"]),
            st.integers(0, 10**9),
        ),
        max_size=40,
    )
)
def test_measured_sizes_tell_every_worker_each_live_measurement_exactly_once(events):
    """Whatever the order of events, a worker is told a key's measurement
    once between two forgets (or its removal), and never a forgotten key's."""
    sizes = MeasuredSizes()
    live: dict[str, int] = {}
    told: set[tuple[str, str]] = set()
    for op, key, worker, n in events:
        if op == "measure":
            sizes.measured(key, n)
            live[key] = n
        elif op == "forget":
            sizes.forget(key)
            live.pop(key, None)
            told = {t for t in told if t[0] != key}
        elif op == "remove":
            sizes.worker_removed(worker)
            told = {t for t in told if t[1] != worker}
        else:
            got = sizes.consumer_placed(worker, [key])
            want = {key: live[key]} if key in live and (key, worker) not in told else {}
            assert got == want
            if got:
                told.add((key, worker))
        assert sizes.size(key, 0) == live.get(key, 0)


# ------------------------------------------------------------ on a cluster


@gen_cluster(client=True, nthreads=[("", 1)] * 4, config=SMALL)
async def test_an_object_dask_sizes_small_travels_through_hoplite_serialised_once(c, s, *workers):
    await c.register_plugin(Hoplite())
    src, *others = workers
    Wrapped.serialised = 0
    x = c.submit(make, PAYLOAD, workers=[src.address])
    await wait(x)
    assert s.tasks[x.key].nbytes < 64 * 1024  # Dask's estimate, left as it was
    futs = [c.submit(digest, x, i, workers=[w.address], pure=False) for i, w in enumerate(others)]
    assert await c.gather(futs) == [expected(PAYLOAD)] * 3
    for w in others:
        assert hoplite_entries(w, x.key) == [True], w.address
        assert w.plugins["hoplite-worker"].stats.get("keys-received") == 1
    assert Wrapped.serialised == 1
    assert s.tasks[x.key].nbytes < 64 * 1024
    sizes = s.plugins["hoplite"].sizes.sizes
    assert sizes.size(x.key, 0) >= PAYLOAD
    del x, futs
    while len(sizes):  # released with the key, as the directory's entries are
        await _tick()


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 4,
    config={**SMALL, "hoplite.measure-unsized": False},
)
async def test_unmeasured_the_same_object_goes_dask_s_way_serialised_per_receiver(c, s, *workers):
    """The counterpart of the test above: with measuring off, each consumer
    pulls its own copy through Dask, serialised for each of them."""
    await c.register_plugin(Hoplite())
    src, *others = workers
    Wrapped.serialised = 0
    x = c.submit(make, PAYLOAD, workers=[src.address])
    await wait(x)
    futs = [c.submit(digest, x, i, workers=[w.address], pure=False) for i, w in enumerate(others)]
    assert await c.gather(futs) == [expected(PAYLOAD)] * 3
    for w in others:
        assert hoplite_entries(w, x.key) == [False], w.address
    assert Wrapped.serialised == 3


@gen_cluster(client=True, nthreads=[("", 1)] * 3, config=SMALL)
async def test_a_small_unsized_object_stays_on_dask_s_path_and_nothing_is_kept(c, s, *workers):
    await c.register_plugin(Hoplite())
    src, *others = workers
    x = c.submit(make, 1000, workers=[src.address])
    await wait(x)
    futs = [c.submit(digest, x, i, workers=[w.address], pure=False) for i, w in enumerate(others)]
    assert await c.gather(futs) == [expected(1000)] * 2
    for w in others:
        assert hoplite_entries(w, x.key) == [False]
    assert len(src.plugins["hoplite-worker"].store) == 0
    assert src.plugins["hoplite-worker"].stats.get("keys-measured", 0) == 0
    assert len(s.plugins["hoplite"].sizes.sizes) == 0


async def _tick() -> None:
    import asyncio

    await asyncio.sleep(0.01)
