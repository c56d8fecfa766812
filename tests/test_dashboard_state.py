"""The /hoplite page's data, from plain inputs: edges with their bytes so far
and status, collectives as a ratio to S/B, counters summed over workers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dask_hoplite.core.store import BufferPool, Layout, ObjectBuffer
from dask_hoplite.dashboard.state import COLOURS, page_state
from dask_hoplite.worker.context import IncomingStream
from dask_hoplite.worker.progress import ProgressReport

A, B, C = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.3:1"


def stream(key, sender, progress, nbytes, stalled=0.0, resumed_from=0, kind="object"):
    return {
        "key": key,
        "sender": sender,
        "kind": kind,
        "progress": progress,
        "nbytes": nbytes,
        "stalled": stalled,
        "resumed_from": resumed_from,
    }


def state(**kw):
    args = dict(
        workers=[A, B, C],
        reports={},
        transfers=[],
        collectives=[],
        bandwidth=100e6,
        counters={},
        stall_after=1.0,
    )
    args.update(kw)
    return page_state(**args)


def test_a_chain_is_drawn_with_the_bytes_so_far_and_each_edges_status():
    s = state(
        reports={
            B: {"streams": [stream("x", A, 50, 100)], "stats": {"resumes": 1}},
            C: {"streams": [stream("x", B, 20, 100, stalled=3.0)], "stats": {"resumes": 2}},
        },
        # The directory assigned one more stream that no heartbeat shows yet.
        transfers=[("x", A, B), ("y", A, C)],
        counters={"directory-entries": 2},
    )
    e = s["edges"]
    rows = sorted(
        zip(e["key"], e["sender"], e["receiver"], e["progress"], e["status"], strict=True)
    )
    assert rows == [
        ("x", A, B, 50, "streaming"),
        ("x", B, C, 20, "stalled"),
        ("y", A, C, 0, "streaming"),
    ]
    assert e["colour"][e["status"].index("stalled")] == COLOURS["stalled"]
    assert e["fraction"][0] == 0.5
    # Segments start at the sender's position and end at the receiver's.
    w = s["workers"]
    pos = dict(zip(w["address"], zip(w["x"], w["y"], strict=True), strict=True))
    assert (e["x0"][0], e["y0"][0]) == pos[A] and (e["x1"][0], e["y1"][0]) == pos[B]
    assert dict(zip(s["counters"]["name"], s["counters"]["value"], strict=True)) == {
        "directory-entries": 2,
        "resumes": 3,
    }


def test_a_resumed_stream_and_a_collectives_ratio_to_the_bound():
    s = state(
        reports={B: {"streams": [stream("p", C, 10, 100, resumed_from=10, kind="reduce")]}},
        collectives=[
            {"kind": "reduce", "outcome": "ok", "inputs": 4, "nbytes": 200e6, "seconds": 3}
        ],
    )
    assert s["edges"]["status"] == ["resumed"] and s["edges"]["kind"] == ["reduce"]
    c = s["collectives"]
    assert c["bound"] == [2.0] and c["ratio"] == [1.5]


@given(
    st.lists(
        st.tuples(
            st.sampled_from([A, B, C]),
            st.sampled_from([A, B, C]),
            st.integers(0, 10**9),
            st.integers(0, 10**9),
            st.floats(0, 100),
        ),
        max_size=20,
    )
)
def test_every_column_has_one_value_per_edge(streams):
    reports: dict = {}
    for receiver, sender, a, b, stalled in streams:
        reports.setdefault(receiver, {"streams": []})["streams"].append(
            stream("k", sender, min(a, b), max(a, b), stalled)
        )
    e = state(reports=reports)["edges"]
    assert {len(v) for v in e.values()} == {len(streams)}
    assert all(0 <= f <= 1 for f in e["fraction"])
    assert set(e["status"]) <= set(COLOURS)


class Ctx:
    def __init__(self):
        self.incoming = set()
        self.stats = {"bytes-received": 7}


def test_the_heartbeat_report_says_how_long_a_stream_has_not_moved():
    now = [0.0]
    ctx = Ctx()
    buf = ObjectBuffer("x", BufferPool(0))
    ctx.incoming.add(IncomingStream("x", A, buf, "object"))
    report = ProgressReport(ctx, clock=lambda: now[0])
    assert report()["streams"][0]["stalled"] == 0.0
    now[0] = 2.5
    (s,) = report()["streams"]
    assert s["stalled"] == 2.5 and s["sender"] == A and s["progress"] == 0
    assert report()["stats"] == {"bytes-received": 7}


def test_a_finished_streams_memory_is_reusable_before_the_next_heartbeat():
    # A loop's next transfer starts before the next heartbeat: if the report
    # still held the finished stream, its buffer's region would not be back
    # in the pool, and the next receiver would zero fresh memory instead.
    ctx = Ctx()
    pool = BufferPool(capacity=64 * 2**20)
    buf = ObjectBuffer("x", pool)
    buf.allocate(Layout({}, (4 * 2**20,)))
    s = IncomingStream("x", A, buf, "object")
    ctx.incoming.add(s)
    report = ProgressReport(ctx)
    assert report()["streams"][0]["nbytes"] == 4 * 2**20
    ctx.incoming.discard(s)
    del s, buf
    assert pool.idle_bytes == 4 * 2**20
    pool.allocate(4 * 2**20)
    assert (pool.reused, pool.allocated) == (1, 1)
