"""``benchmarks/real_clients.py`` end to end on a small emulated cluster (real
namespaces, real processes, unchanged scikit-learn, joblib and dask.dataframe):
every workload runs with and without the plugin, writes its rows, gives the
same answers both ways, and its large keys go through hoplite. Needs root and
iproute2 (CI has both); skipped elsewhere."""

from __future__ import annotations

import pytest
from benchmark_scripts import emulated_cluster_marks, run_script

pytestmark = emulated_cluster_marks()


def _run(out: str, timeout: float, *args: str) -> tuple[str, dict[str, dict]]:
    """The script on 3 emulated workers at 1 Gbit/s, one warm repetition:
    its output, and its rows by op."""
    done, rows = run_script(
        "real_clients.py",
        out,
        timeout,
        *("--workers", "3", "--rate-mbit", "1000", "--reps", "1", *args),
    )
    return done.stdout, {r["op"]: r for r in rows}


@pytest.mark.timeout(900)
def test_every_real_client_runs_with_and_without_the_plugin_to_the_same_answers(tmp_path):
    stdout, rows = _run(
        str(tmp_path / "real"),
        880,
        *("--x-bytes", "8MiB", "--table-bytes", "4MiB", "--model-bytes", "4MiB"),
    )
    for method in ("dask", "hoplite"):
        for op in ("gridsearch", "scatter", "gridsearch-prescattered", "merge", "model"):
            r = rows[f"{method}-{op}"]
            assert len(r["all_seconds"]) == 2 and r["ok"], r
    assert "merge: the results with and without the plugin are the same: True" in stdout
    assert "model: the results with and without the plugin are the same: True" in stdout
    assert "best parameters identical with and without the plugin: True" in stdout
    for op in ("merge", "model"):
        assert rows[f"dask-{op}"]["extra"] == {
            k: v
            for k, v in rows[f"hoplite-{op}"]["extra"].items()
            if not k.startswith(("keys", "local"))
        }
    # X and y reach both other workers in each search through hoplite; the
    # model, which Dask sizes at 56 bytes, is measured where it is fitted
    # and reaches both other workers through hoplite too.
    assert rows["hoplite-gridsearch"]["extra"]["keys-received"] >= 4
    assert rows["hoplite-model"]["extra"]["keys-measured"] == 2  # one per repetition
    assert rows["hoplite-model"]["extra"]["keys-received"] == 4


@pytest.mark.timeout(600)
def test_the_search_with_its_fits_stood_in_by_sleeps_gives_the_same_best_both_ways(tmp_path):
    """``--fit-compute sleep``: the estimator's fit and score sleep their
    measured single-core time; the search still scores every parameter value
    on its data, the same way with and without the plugin."""
    stdout, rows = _run(
        str(tmp_path / "slept"),
        580,
        *("--x-bytes", "8MiB", "--workloads", "gridsearch", "--fit-compute", "sleep"),
    )
    assert "# single-core GaussianNB on half of X: fit " in stdout
    assert "best parameters identical with and without the plugin: True" in stdout
    for method in ("dask", "hoplite"):
        for op in ("gridsearch", "scatter", "gridsearch-prescattered"):
            r = rows[f"{method}-{op}"]
            assert r["note"].startswith("fit+score slept ") and r["extra"]["fit_seconds"] > 0
    assert rows["hoplite-gridsearch"]["extra"]["keys-received"] >= 4
