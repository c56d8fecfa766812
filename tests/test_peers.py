"""The peers benchmark's pure parts: bounds per operation, the memory plan and
the table (no network namespaces, no peers installed needed)."""

from __future__ import annotations

import pytest

from benchmarks.peers import fits, format_markdown, format_table, plan, rows_for_table
from benchmarks.peers_common import Measured, bound_factor, mark, unmark

MiB = 2**20


def test_bound_factors_at_n8() -> None:
    assert bound_factor("broadcast", 8) == 1.0
    assert bound_factor("reduce", 8) == 1.0
    assert bound_factor("allreduce", 8) == pytest.approx(1.75)
    assert bound_factor("gather", 8) == 7.0
    assert bound_factor("allgather", 8) == 7.0
    assert bound_factor("roundtrip", 8) == 2.0
    with pytest.raises(ValueError):
        bound_factor("scatter", 8)


def test_memory_plan_leaves_out_what_does_not_fit() -> None:
    free = 20 * 2**30
    assert fits("broadcast", 8, 256 * MiB, free)
    assert not fits("allgather", 8, 256 * MiB, free)  # 72 objects of 256 MiB
    grid, skipped = plan(["broadcast", "allgather"], [MiB, 256 * MiB], 8, free)
    assert grid == [(MiB, ["broadcast", "allgather"]), (256 * MiB, ["broadcast"])]
    assert skipped == [(256 * MiB, "allgather")]


def test_marked_lines_round_trip() -> None:
    text = "noise\n" + mark('{"a": 1}') + "\nmore\n"
    assert unmark(text) == ['{"a": 1}']


def test_table_ratios_and_unavailable_rows() -> None:
    rate = 125e6
    results = [
        Measured("dask", "broadcast", 125 * 10**6 // 8 * 8, 8, [3.0, 2.0, 2.0]),
        Measured("hoplite", "broadcast", 125 * 10**6 // 8 * 8, 8, [2.0, 1.0, 1.0]),
        Measured("ray", "broadcast", 125 * 10**6 // 8 * 8, 8, available=False, note="no ray"),
        Measured("gloo", "broadcast", 125 * 10**6 // 8 * 8, 8, [float("inf")], False, "hung"),
    ]
    rows = {r["system"]: r for r in rows_for_table(results, rate)}
    assert rows["hoplite"]["x_bound"] == pytest.approx(1.0)
    assert rows["hoplite"]["x_dask"] == pytest.approx(0.5)
    assert rows["ray"]["seconds"] is None and rows["gloo"]["x_bound"] is None
    text = format_table(list(rows.values()))
    assert "not available: no ray" in text and "FAILED hung" in text
    md = format_markdown(list(rows.values()))
    assert md.count("\n") == 5 and "not available: no ray" in md
