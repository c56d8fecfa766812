"""Models as torch tensors (the ``torch`` extra: skipped without torch).

The leaf protocol itself is tested with a stand-in class in
``tests/test_pytrees.py``; here, real CPU tensors, as a ``state_dict`` holds
them, on a cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys

import dask
import pytest

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses

torch = pytest.importorskip("torch")

PATHS = {"tree": {"hoplite.min-bytes": 0}, "one-task": {"hoplite.min-bytes": "1 GiB"}}


def scatter(client, values):
    ws = worker_addresses(client)
    # a list of one: scatter would scatter a dict's values one by one
    return [
        client.scatter([v], workers=[ws[i % len(ws)]], hash=False)[0] for i, v in enumerate(values)
    ]


def test_torch_tensors_come_back_as_tensors(client):
    states = [
        {"fc.weight": torch.full((64, 32), float(i)), "fc.bias": torch.arange(64.0) * i}
        for i in range(4)
    ]
    futures = scatter(client, states)
    for path in ["tree", "one-task"]:
        with dask.config.set(PATHS[path]):
            total = dh.reduce(futures, "sum").result()
            outputs = dh.allreduce(futures, "sum")
        for got in [total, *(o.result() for o in outputs)]:
            assert type(got["fc.weight"]) is torch.Tensor
            assert torch.equal(got["fc.weight"], torch.full((64, 32), 6.0))
            assert torch.equal(got["fc.bias"], torch.arange(64.0) * 6)


def test_a_modules_state_dict_reduces_to_the_average_model(client):
    """Three replicas of one network, each trained a little differently:
    the mean of their state_dicts loads back into the network."""
    torch.manual_seed(0)
    nets = [
        torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        for _ in range(3)
    ]
    states = [net.state_dict() for net in nets]
    with dask.config.set(PATHS["tree"]):
        mean = dh.reduce(scatter(client, states), "mean").result()
    assert list(mean) == list(states[0])  # the state_dict's own order
    for name, tensor in mean.items():
        assert type(tensor) is torch.Tensor
        torch.testing.assert_close(tensor, sum(s[name] for s in states) / 3)
    nets[0].load_state_dict(mean)


@pytest.mark.timeout(180)
def test_the_parameter_server_trains_a_model_of_tensors_as_numpy_does(tmp_path):
    """examples/async_sgd_torch.py: shards, weights and gradients as tensors,
    reduced by dh.reduce, and the weights checked against numpy's."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    args = ["--workers", "2", "--params", "20000", "--samples", "2000", "--k", "2", "--steps", "3"]
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "async_sgd_torch.py"),
            *args,
            "--plot",
            str(tmp_path / "loss.png"),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "DASK_HOPLITE__MIN_BYTES": "1 KiB"},
        cwd=root,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "(torch tensors)" in r.stdout and "results agree: yes" in r.stdout
