"""A key received in byte ranges, without a network: the buffer fills range
by range in any interleaving and serves each range as it lands, a copy
received whole so far continues in ranges, and the directory tracks each
range as a record of its own that Dask's events about the key reach."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dask_hoplite.core.byte_ranges import describe, range_bounds, range_key, whole_key
from dask_hoplite.core.directory import Assign, ObjectDirectory
from dask_hoplite.core.protocol import PROTOCOL_VERSION, StreamRequest
from dask_hoplite.core.store import BufferState, Layout, ObjectBuffer
from dask_hoplite.errors import BufferStateError, ProtocolError


@settings(max_examples=200, deadline=None)
@given(nbytes=st.integers(0, 5000), parts=st.integers(1, 9))
def test_ranges_cover_the_object_exactly_in_order(nbytes, parts):
    bounds = [range_bounds(nbytes, j, parts) for j in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert max(hi - lo for lo, hi in bounds) - min(hi - lo for lo, hi in bounds) <= 1


def test_a_range_key_names_its_whole_key():
    assert whole_key(range_key("x", 1, 4)) == "x"
    assert describe(range_key("x", 1, 4)) == "x (range 2/4)" and describe("x") == "x"
    assert whole_key(("x", 1)) is None and whole_key("x") is None
    with pytest.raises(ValueError, match="range 4 of 4"):
        range_bounds(10, 4, 4)


@settings(max_examples=200, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=400),
    parts=st.integers(2, 6),
    block=st.integers(1, 50),
    order=st.randoms(use_true_random=False),
    split_first=st.booleans(),
)
def test_any_interleaving_of_ranges_fills_the_buffer_and_serves_each_range_as_it_lands(
    data, parts, block, order, split_first
):
    buf = ObjectBuffer("k")
    if split_first:
        buf.split(parts)
    buf.allocate(Layout({}, (len(data),)))
    buf.split(parts)  # again, or for the first time once the layout is known
    bounds = [range_bounds(len(data), j, parts) for j in range(parts)]
    pos = [lo for lo, _ in bounds]
    woken: list[int] = []
    for j, (lo, hi) in enumerate(bounds):
        if lo < hi:  # a reader of range j waits for its first byte
            buf.when(lo, lambda b, j=j: woken.append(j))
    while buf.state is not BufferState.COMPLETE:
        j = order.choice([j for j in range(parts) if pos[j] < bounds[j][1]])
        lo, hi = bounds[j]
        end = min(hi, pos[j] + block)
        view = buf.writable_view(pos[j], end)
        view[:] = data[pos[j] : end]
        assert buf.advance(end) == end
        pos[j] = end
        assert buf.available(lo) >= end  # the range serves what landed
        assert bytes(buf.view(lo, end)) == data[lo:end]
        assert j in woken
        assert buf.progress == sum(p - b[0] for p, b in zip(pos, bounds, strict=True))
    assert bytes(buf.frames()[0]) == data
    assert sorted(woken) == [j for j, (lo, hi) in enumerate(bounds) if lo < hi]


def test_a_copy_received_whole_so_far_continues_in_ranges():
    buf = ObjectBuffer("k")
    buf.allocate(Layout({}, (100,)))
    buf.write(0, b"a" * 30)
    buf.split(4)  # ranges [0, 25) [25, 50) [50, 75) [75, 100)
    assert [buf.available(lo) for lo in (0, 25, 50, 75)] == [25, 30, 50, 75]
    assert buf.progress == 30
    with pytest.raises(ValueError, match="does not continue"):
        buf.write(55, b"b")  # a gap in range 2
    with pytest.raises(ValueError):
        buf.write(70, b"b" * 10)  # across the end of range 2
    for lo, hi in ((30, 50), (50, 75), (75, 100)):
        buf.write(lo, b"c" * (hi - lo))
    assert buf.state is BufferState.COMPLETE
    assert bytes(buf.frames()[0]) == b"a" * 30 + b"c" * 70
    other = ObjectBuffer("k")
    other.split(4)
    with pytest.raises(BufferStateError, match="in 4 ranges"):
        other.split(3)


def test_a_stream_request_names_its_range_and_covers_only_it():
    req = StreamRequest("x", 0, 64, 1, part=(1, 3))
    msg = req.to_msg()
    msg["protocol"] = PROTOCOL_VERSION
    again = StreamRequest.parse(msg)
    assert again.part == (1, 3)
    assert (again.start(300), again.stop(300)) == (100, 200)
    resumed = StreamRequest("x", 150, 64, 1, part=(1, 3))
    assert (resumed.start(300), resumed.stop(300)) == (150, 200)
    for bad in ([3, 3], [1], "x", [True, 2]):
        with pytest.raises(ProtocolError, match="part must be"):
            StreamRequest.parse({**msg, "part": bad})


def test_the_directory_tracks_each_range_and_dask_s_events_reach_them_all():
    d = ObjectDirectory()
    src, receivers = "tcp://h0:1", [f"tcp://h{i}:1" for i in range(1, 7)]
    d.split_ranges("x", 2, receivers)
    assert d.records_of("x") == [range_key("x", 0, 2), range_key("x", 1, 2)]
    senders = {}
    for r in receivers:
        for j in range(2):
            got = d.request(range_key("x", j, 2), r, [src])
            got = got if isinstance(got, Assign) else None
            if got is None:  # planned below a sender not assigned yet
                continue
            senders[r, j] = got.sender
    # Each range goes down its own tree: the source sends each range once.
    assert [senders.get((r, j)) for r in receivers for j in range(2)].count(src) <= 2
    assert d.pinned("x") >= {src}
    # Dask's events about x reach both ranges' records.
    d.copy_added("x", "tcp://h9:1")
    assert all("tcp://h9:1" in d.objects[k].holders for k in d.records_of("x"))
    d.lost("x")
    assert all(not d.objects[k].holders for k in d.records_of("x") if k in d.objects)
    d.forget("x")
    assert d.objects == {} and d.ranges == {}
    with pytest.raises(ValueError, match="2 ranges or more"):
        d.split_ranges("y", 1, receivers)
