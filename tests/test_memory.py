"""After 200 broadcasts of 50 MB keys that are released, hoplite holds nothing:
workers' memory is back at its starting level, the directory is empty."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.memory import run  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_returns_to_its_starting_level_after_200_broadcasts():
    r = asyncio.run(run(broadcasts=200, size=50_000_000, n_workers=4))
    start, end = r["start"], r["end"]
    assert r["received"] == 200 * 3  # every copy went through hoplite
    for key in ("directory_entries", "active_transfers", "buffers", "tasks"):
        assert end[key] == 0, key
    for addr, rss in end["workers_rss"].items():
        # A single leaked 50 MB buffer would show; allocator noise stays far below.
        assert rss - start["workers_rss"][addr] < 25 * 2**20, (addr, start, end)
        # nor does the last object's buffer stay mapped once idle memory is
        # trimmed: against the worker before any broadcast (the prefaulter's
        # thread once held each receiver's last fresh region for ever)
        assert rss - r["fresh_workers_rss"][addr] < 25 * 2**20, (addr, r["fresh_workers_rss"], end)
    # and the peak shows that the measure sees a 50 MB buffer: against the
    # workers before any broadcast, since from the warm-up on a receiver
    # reuses one pooled buffer (it needed a second only while the heartbeat's
    # progress report held the previous one)
    assert max(r["peak_workers_rss"].values()) - max(r["fresh_workers_rss"].values()) > 40_000_000
