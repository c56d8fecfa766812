"""A parameter server on Dask: k-of-n SGD on a sparse least-squares problem.

The model is a linear regression with P parameters (32 Mi float32, 128 MiB, by
default) on sparse synthetic data: each sample has a few nonzero features, so a
shard's gradient ``X^T (X w - y)`` is a dense P-vector made by one scatter-add.
Every worker holds one data shard. Each step:

1. every worker computes its gradient at the current weights (the gradient
   tasks depend on the weights: Dask moves them to every worker; with
   dask-hoplite, as one pipelined broadcast);
2. the server reduces the first ``k`` of the ``n`` gradients to be ready,
   ``dh.reduce(grads, k=k, to=server)`` (with dask-hoplite a pipelined reduce
   tree rooted on the server; without it, one task on the server that fetches
   them), and adds the sum to the weights (each worker has already scaled its
   gradient by the step size).

``--k`` below ``n`` is the asynchronous variant (the slowest gradients of a
step are dropped); ``k = n`` is synchronous SGD. The loss after every step is
plotted to a PNG. Reports updates per second after the first step, and the
first step's seconds on their own, with Dask alone and with
dask-hoplite, and whether the trained weights agree. (The Hoplite paper reports
asynchronous SGD up to 7.8x faster than on Ray.)

    python examples/async_sgd.py [--emulated] [--params 33554432] [--k 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from distributed import Client, wait  # noqa: E402
from harness import (  # noqa: E402
    Outcome,
    add_cluster_arguments,
    compare,
    describe,
    loop_metrics,
    report,
)

import dask_hoplite as dh  # noqa: E402

NONZEROS = 8  # features per sample


def make_shard(i: int, samples: int, params: int) -> dict[str, np.ndarray]:
    """Shard ``i``: sparse rows (column indices and values) and targets from a
    hidden true weight vector plus noise."""
    rng = np.random.default_rng(1_000 + i)
    cols = rng.integers(0, params, (samples, NONZEROS))
    vals = rng.standard_normal((samples, NONZEROS), dtype=np.float32)
    truth = np.random.default_rng(0).standard_normal(params, dtype=np.float32)
    y = (vals * truth[cols]).sum(axis=1) + 0.01 * rng.standard_normal(samples, dtype=np.float32)
    return {"cols": cols, "vals": vals, "y": y.astype(np.float32)}


def residual(w: np.ndarray, shard: dict[str, np.ndarray]) -> np.ndarray:
    return (shard["vals"] * w[shard["cols"]]).sum(axis=1) - shard["y"]


def scaled_gradient(w: np.ndarray, shard: dict[str, np.ndarray], size: float) -> np.ndarray:
    """The shard's share of the update, ``-size * X^T (X w - y)``, a dense
    float32 vector of len(w): each worker scales its own gradient, so that the
    server adds the reduced sum to the weights in one pass. Computed sparsely
    (one scatter-add of the samples' nonzeros into a zeroed vector)."""
    r = residual(w, shard) * np.float32(-size)
    out = np.zeros(len(w), dtype=np.float32)
    np.add.at(out, shard["cols"].ravel(), (shard["vals"] * r[:, None]).ravel())
    return out


def shard_loss(w: np.ndarray, shard: dict[str, np.ndarray]) -> float:
    return float(0.5 * np.square(residual(w, shard)).sum())


def apply_update(w: np.ndarray, total: np.ndarray) -> np.ndarray:
    """The new weights: ``w`` plus the sum of the workers' scaled gradients."""
    return np.add(w, total)


def publish(w: np.ndarray) -> np.ndarray:
    """The weights the workers read, under a key of their own: Dask's active
    memory manager then drops surplus copies of this key, never the server's
    only copy of the weights it updates (which would cost a transfer back)."""
    return w


def step_size(rate: float, k: int, samples: int, params: int) -> float:
    """``rate`` over the largest curvature of a sum of k shard losses: for
    random sparse rows, about (sqrt(rows per feature) + sqrt(NONZEROS))^2 with
    k * samples * NONZEROS / params rows per feature."""
    per_feature = k * samples * NONZEROS / params
    return rate / (np.sqrt(per_feature) + np.sqrt(NONZEROS)) ** 2


def scaled_gradient_stand_in(
    seconds: float, w: np.ndarray, shard: dict[str, np.ndarray], size: float
) -> np.ndarray:
    """For the benchmark on a machine whose cores the emulated hosts share: a
    vector the size of :func:`scaled_gradient`'s after ``seconds`` (its single-core time)
    of sleep instead of the computation, making the vector included. The
    examples never use it."""
    t0 = time.perf_counter()
    out = np.full(len(w), 1e-9, dtype=np.float32)
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    return out


def zeros(params: int) -> np.ndarray:
    return np.zeros(params, dtype=np.float32)


def workload(
    client: Client,
    workers: list[str],
    params: int,
    samples: int,
    k: int,
    steps: int,
    rate: float,
    stand_in: float | None = None,
) -> Outcome:
    """Train; the result is the weights, the loss after each step and which
    shards each step used, the metrics the steps' rate
    (:func:`harness.loop_metrics`). ``stand_in``: seconds of sleep that replace
    each gradient's computation (:func:`scaled_gradient_stand_in`)."""
    grad = (
        scaled_gradient
        if stand_in is None
        else functools.partial(scaled_gradient_stand_in, stand_in)
    )
    server = workers[0]
    shards = [
        client.submit(make_shard, i, samples, params, workers=[w]) for i, w in enumerate(workers)
    ]
    w_fut = client.submit(zeros, params, workers=[server])
    wait([*shards, w_fut])
    size = step_size(rate, k, samples, params)  # the same k every step
    losses, used, seconds = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        published = client.submit(publish, w_fut, workers=[server], pure=False)
        grads = [
            client.submit(grad, published, s, size, workers=[a], pure=False)
            for s, a in zip(shards, workers, strict=True)
        ]
        total = dh.reduce(grads, "sum", k=k, to=server)
        w_fut = client.submit(apply_update, w_fut, total, workers=[server], pure=False)
        keys = [g.key for g in grads]
        used.append(sorted(keys.index(key) for key in dh.reduced_inputs(total)))
        wait(w_fut)
        seconds.append(time.perf_counter() - t0)
        # The loss of the new weights, on every shard, on the server (not
        # timed; the shards are copied there once): computing it on the
        # shards' workers would move the weights there outside the timing.
        losses.append(
            sum(
                client.gather(
                    [client.submit(shard_loss, w_fut, s, workers=[server]) for s in shards]
                )
            )
        )
    return Outcome(
        {"weights": w_fut.result(), "losses": losses, "used": used},
        loop_metrics(f"updates/s (k={k} of {len(workers)})", "first step, s", seconds),
    )


def reference(n: int, params: int, samples: int, used: list[list[int]], rate: float) -> np.ndarray:
    """The same training in this process with numpy alone, each step summing
    the gradients of the shards that step used."""
    shards = [make_shard(i, samples, params) for i in range(n)]
    w = zeros(params)
    for chosen in used:
        size = step_size(rate, len(chosen), samples, params)
        total = np.sum(
            [scaled_gradient(w, shards[i], size) for i in chosen], axis=0, dtype=np.float32
        )
        w = apply_update(w, total)
    return w


def agree_with_numpy(n: int, params: int, samples: int, rate: float) -> Any:
    """Whether both trainings produced the weights numpy computes from the
    shards each one's steps used (with k < n the two may drop different
    gradients, so each is checked against its own)."""

    def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(
            np.allclose(r["weights"], reference(n, params, samples, r["used"], rate), atol=1e-4)
            for r in (a, b)
        )

    return agree


def plot(losses: dict[str, list[float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the plot is optional: pip install matplotlib
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in losses.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.add_argument("--params", type=int, default=32 * 2**20, help="float32 parameters")
    p.add_argument("--samples", type=int, default=200_000, help="samples per shard")
    p.add_argument("--k", type=int, default=6, help="gradients reduced per step (k of n)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rate", type=float, default=0.5, help="step, relative to the curvature")
    p.add_argument("--plot", default="async_sgd_loss.png")
    args = p.parse_args(argv)
    k = min(args.k, args.workers)
    mib = args.params * 4 / 2**20
    title = f"Parameter server: {mib:.0f} MiB of parameters, k = {k} of {args.workers} gradients"
    print(f"{title}\n{describe(args)}\n", flush=True)
    outcomes = compare(
        args, lambda c, w: workload(c, w, args.params, args.samples, k, args.steps, args.rate)
    )
    status = report(outcomes, agree_with_numpy(args.workers, args.params, args.samples, args.rate))
    plot(
        {
            "Dask": outcomes["dask"].result["losses"],
            "dask-hoplite": outcomes["hoplite"].result["losses"],
        },
        args.plot,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
