"""Per-receiver timelines (``hoplite.timelines``): what a worker records of a
fetch, and the table ``benchmarks/timeline.py`` makes of it."""

from __future__ import annotations

import os
import sys

import dask
import numpy as np
from conftest import three_workers

from dask_hoplite.compat import worker_addresses

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import timeline  # noqa: E402


def test_a_broadcast_leaves_one_timeline_per_receiver():
    with dask.config.set({"hoplite.timelines": True}), three_workers() as c:
        ws = worker_addresses(c)
        x = c.submit(np.arange, 2**22, workers=[ws[0]], pure=False)  # 32 MiB
        copies = [
            c.submit(lambda a: a.sum(), x, workers=[w], pure=False, allow_other_workers=False)
            for w in ws[1:]
        ]
        assert c.gather(copies) == [float(np.arange(2**22).sum())] * 2
        got = timeline.collect(c, x.key)
        assert sorted(got) == ws[1:]  # the holder fetched nothing
        for w in ws[1:]:
            kinds = [e for _, e, _ in got[w]]
            assert kinds[:2] == ["asked", "answered"] and "stream" in kinds
            assert kinds[-1] == "streamed" and got[w][-1][2]["ok"]
            assert got[w][-2][2]["n"] == 2**25  # the last sample: every byte
        rows = timeline.rows(got, t0=min(t for ev in got.values() for t, _, _ in ev))
        assert [r.nbytes for r in rows] == [2**25, 2**25]
        assert all(r.senders and r.first_byte <= r.last_byte for r in rows)
    with three_workers() as c:  # off (the default): nothing is recorded
        ws = worker_addresses(c)
        x = c.submit(np.arange, 2**22, workers=[ws[0]], pure=False)
        c.submit(len, x, workers=[ws[1]], allow_other_workers=False).result()
        assert timeline.collect(c, x.key) == {}


def test_the_table_shows_each_receiver_its_sender_and_its_throughput():
    rate = 100.0  # bytes per second
    events = {
        "tcp://a:1": [
            (10.0, "asked", {}),
            (10.0, "answered", {"sender": "tcp://s:1"}),
            (10.0, "stream", {"mapped": 3}),
            (10.0, "bytes", {"n": 0}),
            (10.5, "bytes", {"n": 50}),  # the full rate
            (11.0, "bytes", {"n": 50}),  # a stall
            (11.5, "bytes", {"n": 100}),
            (11.5, "streamed", {"ok": True, "mapped": 4}),  # received into fresh memory
        ]
    }
    [row] = timeline.rows(events, t0=10.0)
    assert (row.asked, row.first_byte, row.last_byte, row.nbytes) == (0.0, 0.5, 1.5, 100)
    assert row.fresh and row.senders == ["tcp://s:1"]
    text = timeline.render(events, t0=10.0, rate=rate, step=0.5, names={"tcp://a:1": "w1"})
    line = text.splitlines()[-1]
    assert line.startswith("w1") and "fresh" in line and "tcp://s:1" in line
    assert line.endswith("|█ █|")  # full rate, nothing, full rate
