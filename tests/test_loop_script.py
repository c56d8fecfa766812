"""``benchmarks/loop.py`` end to end on a small emulated cluster (real
namespaces, real processes): both methods run their repetitions back to back
on fresh clusters, every consumer sees the source's bytes, and each
repetition is timed from the scheduler's own log. Needs root and iproute2 (CI
has both); skipped elsewhere."""

from __future__ import annotations

import pytest
from benchmark_scripts import emulated_cluster_marks, run_script

pytestmark = emulated_cluster_marks()


@pytest.mark.timeout(600)
def test_the_loop_runs_back_to_back_on_fresh_clusters_for_both_methods(tmp_path):
    done, found = run_script(
        "loop.py",
        str(tmp_path / "loop"),
        580,
        *("--workers", "3", "--rate-mbit", "1000", "--sizes", "4MiB"),
        *("--reps", "2", "--clusters", "2"),
    )
    rows = {r["method"]: r for r in found}
    assert set(rows) == {"dask", "hoplite"}
    for r in rows.values():
        assert r["ok"], r["note"]
        # Two fresh clusters, each a cold repetition and two warm ones, each
        # a positive time from the source's end to the last consumer's.
        assert [len(c) for c in r["clusters"]] == [3, 3]
        assert all(t > 0 for c in r["clusters"] for t in c)
        # and each repetition's CPU steal, a share of the VM's CPU time
        assert [len(c) for c in r["steal"]] == [3, 3]
        assert all(0 <= v <= 1 for c in r["steal"] for v in c)
    assert "p50   p90   max" in done.stdout
    assert "CPU steal, %" in done.stdout
