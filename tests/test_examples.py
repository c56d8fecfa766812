"""The examples compute what numpy computes in one process, through dask-hoplite
(at small sizes, on a 3-worker cluster whose hoplite threshold is 1 KiB), and
run as scripts on a local cluster, printing that Dask alone and dask-hoplite
agree."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from dask_hoplite.compat import worker_addresses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import array_pipeline  # noqa: E402
import async_sgd  # noqa: E402
import bag_fold  # noqa: E402
import ensemble_serving  # noqa: E402
import rl_weights  # noqa: E402


def _hoplite_stats(client):
    per_worker = client.run(lambda dask_worker: dict(dask_worker.plugins["hoplite-worker"].stats))
    out: dict[str, int] = {}
    for stats in per_worker.values():
        for k, v in stats.items():
            out[k] = out.get(k, 0) + v
    return out


def test_ensemble_serving_answers_as_numpy_does(cluster_client):
    workers = worker_addresses(cluster_client)
    before = _hoplite_stats(cluster_client).get("keys-received", 0)
    got = ensemble_serving.workload(cluster_client, workers, n_images=6, queries=3, in_flight=2)
    expected = ensemble_serving.reference(len(workers), n_images=6, queries=3)
    assert ensemble_serving.agree(got.result, expected)
    assert all(
        np.array_equal(g["labels"], e["labels"]) for g, e in zip(got.result, expected, strict=True)
    )
    # every query's batch reached the other two models' workers through hoplite
    assert _hoplite_stats(cluster_client)["keys-received"] - before >= 2 * 3


def test_array_pipeline_computes_the_gram_matrix_numpy_does(cluster_client):
    workers = worker_addresses(cluster_client)
    before = _hoplite_stats(cluster_client)
    got = array_pipeline.workload(cluster_client, workers, d=64, rows=32)
    np.testing.assert_allclose(got.result, array_pipeline.reference(3, d=64, rows=32), rtol=1e-4)
    after = _hoplite_stats(cluster_client)
    assert after.get("graph-reductions", 0) > before.get("graph-reductions", 0)  # y.T @ y's sum


def test_bag_fold_sums_as_numpy_does(cluster_client):
    workers = worker_addresses(cluster_client)
    before = _hoplite_stats(cluster_client).get("graph-reductions", 0)
    got = bag_fold.workload(cluster_client, workers, records=2, features=3_000)
    np.testing.assert_allclose(got.result, bag_fold.reference(3, 2, 3_000), rtol=1e-5)
    assert _hoplite_stats(cluster_client)["graph-reductions"] > before


@pytest.mark.parametrize("k", [2, 3])
def test_parameter_server_trains_as_numpy_does(cluster_client, k):
    """k of 3 gradients per step: the weights are numpy's from the shards each
    step reduced (dh.reduced_inputs), and the loss goes down."""
    workers = worker_addresses(cluster_client)
    got = async_sgd.workload(cluster_client, workers, 2_000, 500, k=k, steps=4, rate=0.5)
    used = got.result["used"]
    assert [len(u) for u in used] == [k] * 4
    expected = async_sgd.reference(3, 2_000, 500, used, rate=0.5)
    assert list(got.result["weights"]) == list(async_sgd.FIELDS)  # the model's fields
    for field, weights in expected.items():
        np.testing.assert_allclose(got.result["weights"][field], weights, atol=1e-5)
    losses = got.result["losses"]
    assert losses[-1] < losses[0]


def test_rl_learner_policy_is_numpys(cluster_client):
    workers = worker_addresses(cluster_client)
    got = rl_weights.workload(cluster_client, workers, obs=256, actions=8, steps=16, iterations=3)
    expected = rl_weights.reference(3, obs=256, actions=8, steps=16, iterations=3)
    for layer in ("hidden", "out"):
        for name in ("weight", "bias"):
            np.testing.assert_allclose(
                got.result["policy"][layer][name], expected[layer][name], rtol=1e-4, atol=1e-6
            )
    assert np.abs(expected["out"]["weight"]).sum() > 0  # it did learn something


def _shapes(x):
    if isinstance(x, dict):
        return {k: _shapes(v) for k, v in x.items()}
    return (x.shape, x.dtype)


def test_the_benchmarks_stand_ins_return_what_the_computations_return():
    """benchmarks/applications.py --sleep replaces these computations by a
    sleep: what the next task receives must keep its shapes and types."""
    model, batch = ensemble_serving.load_model(0), ensemble_serving.load_batch(0, 2)
    assert _shapes(ensemble_serving.predict_stand_in(0.01, model, batch)) == _shapes(
        ensemble_serving.predict(model, batch)
    )
    w, shard = async_sgd.zeros(1_000), async_sgd.make_shard(0, 100, 1_000)
    assert _shapes(async_sgd.scaled_gradient_stand_in(0.01, w, shard, 0.1)) == _shapes(
        async_sgd.scaled_gradient(w, shard, 0.1)
    )
    policy = rl_weights.init_policy(64, 8)
    assert _shapes(rl_weights.rollout_stand_in(0.01, policy, 0, 0, 16)) == _shapes(
        rl_weights.rollout(policy, 0, 0, 16)
    )


@pytest.mark.parametrize(
    "script, args",
    [
        ("ensemble_serving.py", ["--images", "4", "--queries", "2", "--in-flight", "2"]),
        ("array_pipeline.py", ["--d", "64", "--rows-per-worker", "16"]),
        ("bag_fold.py", ["--features", "3000", "--records", "2"]),
        ("async_sgd.py", ["--params", "2000", "--samples", "500", "--k", "1", "--steps", "3"]),
        ("rl_weights.py", ["--obs", "256", "--actions", "8", "--steps", "16", "--iterations", "3"]),
    ],
)
@pytest.mark.timeout(180)
def test_example_runs_as_a_script_on_a_local_cluster(script, args, tmp_path):
    env = {**os.environ, "DASK_HOPLITE__MIN_BYTES": "1 KiB"}
    if script == "async_sgd.py":
        args = [*args, "--plot", str(tmp_path / "loss.png")]
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script), "--workers", "2", *args],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "results agree: yes" in r.stdout
    assert "dask-hoplite" in r.stdout and "gain" in r.stdout
    if script == "async_sgd.py":
        assert (tmp_path / "loss.png").stat().st_size > 0


def test_the_benchmark_reports_the_cpu_time_its_hypervisor_took():
    """benchmarks/applications.py prints the steal share of each application's
    runs (a busy virtual-machine host slows every figure of a run)."""
    sys.path.insert(0, ROOT)
    from benchmarks.cpu_steal import cpu_times, steal_share

    before = cpu_times()
    assert len(before) == 8 and all(t >= 0 for t in before)
    assert 0.0 <= steal_share(before, cpu_times()) <= 1.0
    # user 10, idle 10, steal 20 ticks: half the time was taken away
    assert steal_share([0] * 8, [10, 0, 0, 10, 0, 0, 0, 20]) == 0.5
