"""The block store without a network: layouts, in-order writes, waiters,
the buffer pool's reuse rules."""

from __future__ import annotations

import gc
import time
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.buffer_pool import (
    AUTO_RESERVE_MAX,
    AUTO_RESERVE_MIN,
    ReserveExtents,
    auto_reserve,
)
from dask_hoplite.core.store import (
    BlockStore,
    BufferPool,
    BufferState,
    Layout,
    LayoutChanged,
    ObjectBuffer,
)
from dask_hoplite.errors import BufferStateError, TransferFailed


def test_layout_blocks_never_span_frames():
    layout = Layout({}, (5, 0, 7))
    assert layout.nbytes == 12
    assert layout.block_end(0, 100) == 5
    assert layout.block_end(5, 3) == 8
    assert layout.block_end(8, 100) == 12
    with pytest.raises(ValueError, match="outside"):
        layout.block_end(12, 1)


def test_layout_from_msg_rejects_malformed():
    with pytest.raises(ValueError, match="malformed"):
        Layout.from_msg({"header": {}, "lengths": [1, -2]})
    with pytest.raises(ValueError, match="malformed"):
        Layout.from_msg({"lengths": [1]})


def test_writes_advance_progress_and_wake_waiters_in_order():
    buf = ObjectBuffer("k")
    woken = []
    buf.when(0, lambda b: woken.append(("layout", b.progress)))
    buf.allocate(Layout({}, (10,)))
    assert woken == [("layout", 0)] or woken == []  # threshold 0 needs a byte
    buf.when(4, lambda b: woken.append(("past4", b.progress)))
    buf.write(0, b"abcd")
    assert ("past4", 4) not in woken
    buf.write(4, b"ef")
    assert ("past4", 6) in woken
    with pytest.raises(ValueError, match="does not continue"):
        buf.write(8, b"zz")  # gap
    buf.write(3, b"def")  # overlap (a resumed stream) is fine
    buf.write(6, b"ghij")
    assert buf.state is BufferState.COMPLETE
    assert bytes(buf.frames()[0]) == b"abcdefghij"


def test_fail_wakes_everyone_and_rejects_writes():
    buf = ObjectBuffer("k")
    buf.allocate(Layout({}, (10,)))
    seen = []
    buf.when(5, lambda b: seen.append(b.state))
    buf.fail(RuntimeError("peer died"))
    assert seen == [BufferState.FAILED]
    with pytest.raises(BufferStateError, match="not receiving"):
        buf.write(0, b"x")


def test_interrupt_stops_readers_but_keeps_the_bytes_for_a_resume():
    """A partial copy kept while its object is recomputed: its readers give
    up at once, its own receiving resumes where it stopped."""
    buf = ObjectBuffer("k")
    buf.allocate(Layout({}, (10,)))
    buf.write(0, b"abcd")
    woken = []
    buf.when(4, lambda b: woken.append(b.interrupted))
    buf.interrupt(KeyError("released"))
    assert len(woken) == 1 and isinstance(woken[0], KeyError)
    buf.when(6, lambda b: woken.append("late reader"))  # no waiting on it either
    assert woken[-1] == "late reader"
    assert buf.state is BufferState.RECEIVING and buf.progress == 4
    buf.resume()
    buf.when(6, lambda b: woken.append(b.progress))
    assert woken[-1] == "late reader"  # waits again for real progress
    buf.write(4, b"efghij")  # the resumed stream continues at byte 4
    assert woken[-1] == 10 and buf.state is BufferState.COMPLETE
    assert bytes(buf.frames()[0]) == b"abcdefghij"
    buf.interrupt(KeyError("too late"))  # a complete copy is not interrupted
    assert buf.interrupted is None


def test_readers_of_an_interrupted_copy_fail_fast():
    import asyncio

    from dask_hoplite.worker.streams import wait_progress

    async def main() -> None:
        buf = ObjectBuffer("k")
        buf.allocate(Layout({}, (10,)))
        buf.write(0, b"ab")
        buf.interrupt(KeyError("released"))
        with pytest.raises(TransferFailed, match="stopped"):
            await wait_progress(buf, 2, timeout=60)
        await wait_progress(buf, 1, timeout=60)  # bytes it has are still served

    asyncio.run(main())


def test_empty_object_completes_on_allocation():
    buf = ObjectBuffer("k")
    buf.allocate(Layout({}, ()))
    assert buf.state is BufferState.COMPLETE and buf.frames() == []


def test_layout_mismatch_between_senders_is_an_error():
    buf = ObjectBuffer("k")
    buf.allocate(Layout({}, (4,)))
    with pytest.raises(ValueError, match="changed between senders"):
        buf.allocate(Layout({}, (5,)))


def test_store_release_fails_partial_buffers_but_keeps_complete_ones_readable():
    store = BlockStore()
    partial = store.announce("a")
    partial.allocate(Layout({}, (4,)))
    full = store.add_source("b", {}, [b"1234"])
    assert store.release("a") is partial and partial.state is BufferState.FAILED
    assert store.release("b") is full and bytes(full.frames()[0]) == b"1234"
    assert len(store) == 0 and store.nbytes == 0


def test_source_buffer_over_noncontiguous_frame_copies_once():
    x = np.arange(20, dtype="i8").reshape(4, 5)[:, ::2]
    buf = ObjectBuffer.from_frames("k", {}, [memoryview(x)])
    assert bytes(buf.frames()[0]) == np.ascontiguousarray(x).tobytes()


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(st.binary(max_size=300), max_size=5),
    block=st.integers(1, 64),
)
def test_streaming_any_layout_in_blocks_reassembles_the_bytes(frames, block):
    src = ObjectBuffer.from_frames("k", {"h": 1}, frames)
    dst = ObjectBuffer("k")
    dst.allocate(Layout.from_msg(src.layout.to_msg()))
    pos, total = 0, src.nbytes
    while pos < total:
        end = src.layout.block_end(pos, block)
        dst.write(pos, src.view(pos, end))
        pos = end
    assert dst.state is BufferState.COMPLETE
    assert [bytes(f) for f in dst.frames()] == frames


def test_pool_reuses_a_region_only_after_every_reference_died():
    pool = BufferPool(capacity=64 * 2**20)
    n = 3 * 2**20 + 5
    a = pool.allocate(n)
    view = memoryview(a)[10:20]
    user = np.frombuffer(view, dtype=np.uint8)  # like a deserialised object
    user_slice = user[2:]
    del a, view, user
    gc.collect()
    b = pool.allocate(n)  # the first region is still referenced: a new one
    assert pool.reused == 0
    assert not np.shares_memory(b, user_slice)
    del user_slice
    gc.collect()
    c = pool.allocate(n)
    assert pool.reused == 1 and c.size == n
    del b, c
    gc.collect()
    assert pool.idle_bytes == 2 * 4 * 2**20


def test_pool_region_outlives_its_array_through_every_route_a_consumer_takes():
    """Found by the chaos test: a deserialised result lost its memory to the
    pool while still in use, because numpy collapses view bases past a
    non-owning array straight to the mmap, and Dask's deserialisation then
    exported the mmap itself. Every derived object must pin the region."""
    from distributed.protocol import deserialize, serialize

    pool = BufferPool(capacity=64 * 2**20)
    n = 4 * 2**20
    routes = []
    for make in (
        lambda a: a[8:].view(np.float64),
        lambda a: np.frombuffer(memoryview(memoryview(a)), dtype=np.uint8),
        lambda a: deserialize(*serialize(a.view(np.float64), serializers=("dask",))),
        lambda a: np.asarray(memoryview(a).cast("d")),
    ):
        a = pool.allocate(n)
        a[:] = 7
        user = make(a)
        del a
        gc.collect()
        fresh = pool.allocate(n)  # must not be the region `user` reads
        fresh[:] = 0
        assert not np.shares_memory(fresh, user)
        assert np.all(np.asarray(user).view(np.uint8) == 7)
        routes.append((user, fresh))
    assert pool.reused == 0


def test_pool_capacity_zero_keeps_nothing():
    pool = BufferPool(capacity=0)
    a = pool.allocate(2**21)
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    assert pool.allocate(2**21).size == 2**21 and pool.reused == 0


def test_pool_trim_returns_idle_memory_after_a_while():
    pool = BufferPool(capacity=64 * 2**20)
    a = pool.allocate(2**21)
    del a
    gc.collect()
    assert pool.idle_bytes == 2**21
    assert pool.trim(max_idle=60) == 0  # still fresh
    import time

    assert pool.trim(max_idle=60, now=time.monotonic() + 61) == 2**21
    assert pool.idle_bytes == 0


def test_pool_keeps_a_burst_s_idle_regions_until_the_burst_is_over():
    """A loop holds two buffers now and then (its next transfer starts
    before the previous object is freed): the second region, idle most of
    the time, stays while buffers are still handed out."""
    now = [0.0]
    pool = BufferPool(capacity=64 * 2**20, clock=lambda: now[0])
    a, b = pool.allocate(2**21), pool.allocate(2**22)
    del b  # idle from t=0 (too large for the loop's 2 MiB: never reused)
    gc.collect()
    for _ in range(100):  # the loop goes on for 100 s, reusing ``a``'s region
        now[0] += 1
        del a
        gc.collect()
        a = pool.allocate(2**21)
    assert pool.allocated == 2 and pool.reused == 100 and a.size == 2**21
    # Idle for 100 s, but the burst went on until now: kept.
    assert pool.trim(max_idle=60) == 0
    # Once nothing was handed out for max_idle, it goes.
    now[0] += 61
    assert pool.trim(max_idle=60) == 2**22
    assert pool.idle_bytes == 0


def test_pool_maps_one_spare_per_size_in_a_burst():
    """The first 2 MiB buffer back brings a spare: a loop whose next buffer
    is lent before the previous one is back reuses instead of mapping."""
    now = [0.0]
    pool = BufferPool(capacity=64 * 2**20, clock=lambda: now[0], spare=True)
    a = pool.allocate(2**21)
    del a
    gc.collect()
    assert pool.allocated == 2 and pool.idle_bytes == 2 * 2**21
    a = pool.allocate(2**21)  # the next transfer, before ...
    b = pool.allocate(2**21)  # ... the one before it is freed
    assert pool.allocated == 2 and pool.reused == 2
    del a, b
    gc.collect()
    assert pool.allocated == 2  # one spare per size and burst
    now[0] += 61  # the burst is over: all goes
    assert pool.trim(max_idle=60) == 2 * 2**21
    # A worker that never received a large object maps nothing.
    assert BufferPool(capacity=64 * 2**20, spare=True).allocated == 0


def test_pool_picks_the_right_region_among_many_sizes():
    pool = BufferPool(capacity=256 * 2**20)
    regions = [pool.allocate(n * 2**20) for n in (8, 4, 2, 4)]
    del regions
    gc.collect()
    a = pool.allocate(4 * 2**20)  # two 4 MiB regions idle, an 8 and a 2
    b = pool.allocate(4 * 2**20)
    c = pool.allocate(2 * 2**20)
    assert pool.reused == 3 and (a.size, b.size, c.size) == (4 * 2**20, 4 * 2**20, 2 * 2**20)
    assert not np.shares_memory(a, b)
    assert pool.idle_bytes == 8 * 2**20


def test_content_identity_tells_copies_of_one_object_from_another_object():
    a = np.arange(1_000_000, dtype="f8")
    same = ObjectBuffer.from_frames("k", {}, [a.copy()]).layout
    assert ObjectBuffer.from_frames("k", {}, [a]).layout == same
    b = a.copy()
    b[-1] = -1.0  # differs in the last block only
    assert ObjectBuffer.from_frames("k", {}, [b]).layout.identity != same.identity
    c = a.copy()
    c[0] = -1.0
    assert ObjectBuffer.from_frames("k", {}, [c]).layout.identity != same.identity
    # a relay carries the identity on; a resuming receiver refuses another object
    relay = ObjectBuffer("k")
    relay.allocate(Layout.from_msg(same.to_msg()))
    assert relay.layout == same
    with pytest.raises(LayoutChanged, match="changed between senders"):
        relay.allocate(ObjectBuffer.from_frames("k", {}, [b]).layout)


def test_pool_survives_a_region_returned_inside_its_own_lock():
    """Found by the chaos test: a worker froze for minutes. A handle in a
    reference cycle (an exception's traceback holding an array, say) dies in
    whatever garbage collection comes next, and that may be one triggered by
    an allocation in the pool's own bookkeeping, while this thread holds the
    pool's lock. Returning the region then must not wait for that lock. The
    test makes the handle die inside the lock directly, since where a
    collection lands is up to the interpreter."""
    import threading

    pool = BufferPool(capacity=64 * 2**20)
    returned = threading.Event()

    def drop_inside_the_lock() -> None:
        a = pool.allocate(2**21)
        with pool._lock:
            del a  # the finalizer runs here, in this thread
        returned.set()

    t = threading.Thread(target=drop_inside_the_lock, daemon=True)
    t.start()
    t.join(timeout=10)
    assert returned.is_set(), "the pool deadlocked taking back a region inside its own lock"
    assert pool.idle_bytes == 2**21  # filed at the next operation
    b = pool.allocate(2**21)
    assert pool.reused == 1 and b.size == 2**21


def test_partial_copy_adopts_a_local_recomputation_and_its_readers_carry_on():
    """A key is lost mid-stream and recomputed on a worker whose partial copy
    serves a relay: that copy completes from the local value, and a reader
    waiting for the next bytes gets them without a break."""
    a = np.arange(500_000, dtype="f8")
    source = ObjectBuffer.from_frames("k", {"x": 1}, [a])
    buf = ObjectBuffer("k", BufferPool(capacity=64 * 2**20))
    buf.allocate(source.layout)
    half = source.nbytes // 2
    buf.write(0, source.view(0, half))
    woken = []
    buf.when(half, woken.append)  # a reader waiting for byte `half`
    # recomputed alike; its header is the original's before msgpack made lists of tuples
    buf.adopt(ObjectBuffer.from_frames("k", {"x": (1,)}, [a.copy()]))
    assert woken == [buf] and buf.state is BufferState.COMPLETE
    assert bytes(buf.view(half, source.nbytes)) == bytes(source.view(half, source.nbytes))
    # A recomputation that is another object is refused.
    other = ObjectBuffer("k")
    other.allocate(source.layout)
    other.write(0, source.view(0, half))
    with pytest.raises(LayoutChanged, match="another object"):
        other.adopt(ObjectBuffer.from_frames("k", {"x": 1}, [a + 1]))
    assert other.state is BufferState.RECEIVING and other.progress == half


def test_reserved_memory_serves_the_first_objects_and_stays():
    """A worker's reserve (hoplite.buffer-pool-reserve) is mapped up front:
    objects take extents of it, smallest free extent first, until it is full;
    then fresh memory. Extents come back merged, and neither the pool's
    capacity nor trimming gives the reserve back."""
    mib = 2**20
    fresh: list[int] = []
    pool = BufferPool(capacity=0, on_fresh=lambda region: fresh.append(len(region)))
    pool.reserve(40 * mib, regions=2)
    assert fresh == [40 * mib] * 2  # handed to the prefaulter at once
    a = pool.allocate(33 * mib)
    b = pool.allocate(2 * mib)  # into the 7 MiB a left, not the other region
    c = pool.allocate(40 * mib)  # the other region, whole
    d = pool.allocate(5 * mib)  # the last 5 MiB of the first
    assert (pool.reused, pool.allocated, pool.idle_bytes) == (4, 0, 0)
    assert not any(np.shares_memory(x, y) for x, y in [(a, b), (a, c), (b, d), (c, d)])
    e = pool.allocate(1 * mib)  # the reserve is full: fresh memory
    assert pool.allocated == 1 and fresh[-1] == mib
    del a, d, e
    gc.collect()
    assert pool.idle_bytes == 38 * mib  # 33 + 5 of the reserve; the fresh MiB dropped (capacity 0)
    f = pool.allocate(35 * mib)  # does not fit the 33 and the 5 apart
    assert pool.allocated == 2
    del b, f
    gc.collect()
    g = pool.allocate(40 * mib)  # a, b and d merged back into one extent
    assert (pool.reused, pool.allocated) == (5, 2)
    del c, g
    gc.collect()
    assert pool.trim(0.0, now=time.monotonic() + 1e6) == 0
    assert pool.idle_bytes == 80 * mib


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12)), max_size=40))
def test_reserve_extents_never_overlap_and_merge_back_whole(ops):
    """Any sequence of takes and gives of a reserved region: the extents
    taken and the free ones partition the region, and once everything is
    given back the region is one free extent again."""
    region = ReserveExtents(16)
    taken: dict[int, int] = {}
    for give, size in ops:
        if give and taken:
            offset = sorted(taken)[size % len(taken)]
            region.give(offset, taken.pop(offset))
        elif region.smallest_fit(size) is not None:
            offset = region.take(size)
            taken[offset] = size
        spans = sorted([*taken.items(), *region.free])
        assert spans[0][0] == 0 and sum(n for _, n in spans) == 16
        assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(spans, spans[1:], strict=False))
        assert all(
            o1 + n1 < o2 for (o1, n1), (o2, _) in zip(region.free, region.free[1:], strict=False)
        )
    for offset, size in list(taken.items()):
        region.give(offset, size)
    assert region.free == [(0, 16)]


def test_the_automatic_reserve_is_a_sixteenth_of_the_memory_limit_within_its_bounds():
    """``hoplite.buffer-pool-reserve: auto``: a worker of 2 GiB reserves
    128 MiB, a large one 256 MiB, a small one nothing; without a limit the
    host's memory counts."""
    mib = 2**20
    assert auto_reserve(2 * 2**30, 64 * 2**30) == 128 * mib
    assert auto_reserve(32 * 2**30, 64 * 2**30) == AUTO_RESERVE_MAX == 256 * mib
    assert auto_reserve(512 * mib, 64 * 2**30) == 0  # 32 MiB: below AUTO_RESERVE_MIN
    assert auto_reserve(None, 2 * 2**30) == auto_reserve(0, 2 * 2**30) == 128 * mib


@given(limit=st.integers(0, 2**40), host=st.integers(1, 2**40))
def test_the_automatic_reserve_is_whole_mib_bounded_and_grows_with_the_limit(limit, host):
    size = auto_reserve(limit, host)
    assert size == 0 or AUTO_RESERVE_MIN <= size <= AUTO_RESERVE_MAX
    assert size % BufferPool.GRANULE == 0
    assert size <= (limit or host) // 16
    assert auto_reserve(limit * 2, host) >= size if limit else True


def test_the_prefaulter_populates_fresh_regions_in_the_background():
    from dask_hoplite.worker.prefault import Prefaulter

    p = Prefaulter()
    if not p.enabled:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available here")
    pool = BufferPool(capacity=0, on_fresh=p.submit)
    x = pool.allocate(64 * 2**20)
    deadline = time.monotonic() + 10
    while p.populated < 64 * 2**20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.populated == 64 * 2**20
    x[:] = 7  # the memory is the array's, whole and writable
    assert int(x[-1]) == 7
    p.close()


def test_a_populated_region_is_unmapped_once_the_pool_trims_it():
    """The prefaulter lets go of a region once it is populated: after the
    pool trims an idle region, the worker's memory goes back to the OS (it
    stayed mapped, one object's size, for the worker's life)."""
    from dask_hoplite.worker.prefault import Prefaulter

    p = Prefaulter()
    if not p.enabled:
        pytest.skip("madvise(MADV_POPULATE_WRITE) is not available here")
    mapped: list[weakref.ref] = []

    def submit(region):
        mapped.append(weakref.ref(region))
        p.submit(region)

    now = [0.0]
    pool = BufferPool(capacity=2**30, on_fresh=submit, clock=lambda: now[0])
    x = pool.allocate(16 * 2**20)
    deadline = time.monotonic() + 10
    while p.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.populated == 16 * 2**20
    del x
    gc.collect()
    assert pool.idle_bytes == 16 * 2**20
    now[0] = 10.0
    assert pool.trim(1.0) == 16 * 2**20
    assert [r() for r in mapped] == [None]
    p.close()


def test_a_served_buffer_swaps_its_bytes_for_readers_that_come_later():
    """A reduce node that takes a dead node's input into the stream it serves
    (a spread) swaps in new bytes from a byte no live reader has taken: what
    was handed to the dead node's socket does not count."""
    a = np.arange(1024, dtype=np.uint8)
    buf = ObjectBuffer.from_frames("k", {}, [a])
    buf.serving("tcp://parent:1", 256)
    buf.serving("tcp://dead:1", 768)
    buf.serving("tcp://parent:1", 128)  # never lowers
    assert buf.served_to() == 768
    assert buf.served_to(ignore="tcp://dead:1") == 256
    new = np.full(1024, 7, dtype=np.uint8)
    new[:256] = a[:256]
    old_view = buf.view(0, 256)  # a reader mid-write keeps the old bytes
    buf.swap_bytes(new)
    assert bytes(buf.view(0, 256)) == bytes(old_view) == bytes(a[:256])
    assert bytes(buf.view(256, 1024)) == bytes([7]) * 768
    assert a[300] == 300 % 256  # the node's input itself is not written to
    with pytest.raises(ValueError, match="has 1024 bytes"):
        buf.swap_bytes(np.zeros(10, dtype=np.uint8))
    filling = ObjectBuffer("f")
    filling.allocate(buf.layout)
    with pytest.raises(BufferStateError, match="not complete"):
        filling.swap_bytes(new)
