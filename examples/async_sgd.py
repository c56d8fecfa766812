"""A parameter server on Dask: k-of-n SGD on a sparse least-squares problem.

The model is a wide linear regression, as click prediction uses: one weight
vector per feature field (``user``, ``item``, ``context``, ``time``), a dict of
arrays of P parameters in all (32 Mi float32, 128 MiB, by default), trained on
sparse synthetic data: each sample has a few nonzero features in every field,
so a shard's gradient ``X^T (X w - y)`` is a dict of dense vectors, each made
by one scatter-add. Every worker holds one data shard. Each step:

1. every worker computes its gradient at the current weights (the gradient
   tasks depend on the weights: Dask moves them to every worker; with
   dask-hoplite, as one pipelined broadcast);
2. the server reduces the first ``k`` of the ``n`` gradients to be ready,
   ``dh.reduce(grads, k=k, to=server)``, field by field in one tree (with
   dask-hoplite a pipelined reduce tree rooted on the server; without it, one
   task on the server that fetches them), and adds the sum to the weights
   (each worker has already scaled its gradient by the step size).

``--k`` below ``n`` is the asynchronous variant (the slowest gradients of a
step are dropped); ``k = n`` is synchronous SGD. The loss after every step is
plotted to a PNG. Reports updates per second after the first step, and the
first step's seconds on their own, with Dask alone and with
dask-hoplite, and whether the trained weights agree with numpy's. (The Hoplite
paper reports asynchronous SGD up to 7.8x faster than on Ray.)
``examples/async_sgd_torch.py`` trains the same model as torch tensors.

    python examples/async_sgd.py [--emulated] [--params 33554432] [--k 6] [--steps 10]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
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

#: The model's feature fields, each with its share of the parameters (in
#: sixteenths): a weight vector per field.
FIELDS = {"user": 8, "item": 4, "context": 2, "time": 2}
#: Nonzero features per sample in each field.
PER_FIELD = 2

#: A model, or a gradient: one vector per field (numpy arrays, or torch tensors
#: in ``async_sgd_torch.py``).
Model = dict[str, Any]


def field_sizes(params: int) -> dict[str, int]:
    """The length of each field's weight vector (``params`` in all)."""
    sizes = {f: params * share // 16 for f, share in FIELDS.items()}
    sizes["user"] += params - sum(sizes.values())
    return sizes


def make_shard(i: int, samples: int, params: int) -> dict[str, Any]:
    """Shard ``i``: per field, sparse rows (column indices and values), and
    the targets, from hidden true weights plus noise."""
    rng = np.random.default_rng(1_000 + i)
    fields, y = {}, np.zeros(samples, dtype=np.float32)
    for j, (f, size) in enumerate(field_sizes(params).items()):
        cols = rng.integers(0, size, (samples, PER_FIELD))
        vals = rng.standard_normal((samples, PER_FIELD), dtype=np.float32)
        truth = np.random.default_rng([0, j]).standard_normal(size, dtype=np.float32)
        y += (vals * truth[cols]).sum(axis=1)
        fields[f] = {"cols": cols, "vals": vals}
    y += 0.01 * rng.standard_normal(samples, dtype=np.float32)
    return {"fields": fields, "y": y}


def residual(w: Model, shard: dict[str, Any]) -> Any:
    r = -shard["y"]
    for f, part in shard["fields"].items():
        r = r + (part["vals"] * w[f][part["cols"]]).sum(axis=1)
    return r


def scaled_gradient(w: Model, shard: dict[str, Any], size: float) -> Model:
    """The shard's share of the update, ``-size * X^T (X w - y)``: per field, a
    dense float32 vector of the field's length. Each worker scales its own
    gradient, so that the server adds the reduced sum to the weights in one
    pass. Computed sparsely: one scatter-add per field of the samples'
    nonzeros into a zeroed vector (numpy's ``add.at``, or torch's
    ``index_add_`` for tensors)."""
    r = residual(w, shard) * float(-size)
    out = {}
    for f, part in shard["fields"].items():
        g = w[f] * 0
        cols, contrib = part["cols"].reshape(-1), (part["vals"] * r[:, None]).reshape(-1)
        if hasattr(g, "index_add_"):  # a torch tensor
            g.index_add_(0, cols, contrib)
        else:
            np.add.at(g, cols, contrib)
        out[f] = g
    return out


def shard_loss(w: Model, shard: dict[str, Any]) -> float:
    r = residual(w, shard)
    return float(0.5 * (r * r).sum())


def apply_update(w: Model, total: Model) -> Model:
    """The new weights: ``w`` plus the sum of the workers' scaled gradients."""
    return {f: w[f] + total[f] for f in w}


def publish(w: Model) -> Model:
    """The weights the workers read, under a key of their own: Dask's active
    memory manager then drops surplus copies of this key, never the server's
    only copy of the weights it updates (which would cost a transfer back)."""
    return w


def step_size(rate: float, k: int, samples: int, params: int) -> float:
    """``rate`` over the largest curvature of a sum of k shard losses: for
    random sparse rows, about (sqrt(rows per feature) + sqrt(nonzeros per
    row))^2, with the rows per feature of the field whose features the rows
    hit most often (k * samples * PER_FIELD / its length)."""
    per_feature = k * samples * PER_FIELD / min(field_sizes(params).values())
    return rate / (np.sqrt(per_feature) + np.sqrt(PER_FIELD * len(FIELDS))) ** 2


def scaled_gradient_stand_in(seconds: float, w: Model, shard: dict[str, Any], size: float) -> Model:
    """For the benchmark on a machine whose cores the emulated hosts share: a
    gradient of :func:`scaled_gradient`'s shapes (zeros) after ``seconds`` of
    sleep, its single-core time, writing its vectors included, instead of the
    computation. The vectors are mapped, not written (``np.zeros``): writing
    128 MiB in each of 8 worker processes at once on a 2-core machine took
    0.2-0.7 s instead of the single-core time's share, a cost that 8 hosts
    with cores of their own would not pay and that the sleep already counts.
    The examples never use it."""
    out = {f: np.zeros(len(v), dtype=np.float32) for f, v in w.items()}
    time.sleep(seconds)
    return out


def zeros(params: int) -> Model:
    return {f: np.zeros(size, dtype=np.float32) for f, size in field_sizes(params).items()}


def workload(
    client: Client,
    workers: list[str],
    params: int,
    samples: int,
    k: int,
    steps: int,
    rate: float,
    stand_in: float | None = None,
    convert: Callable[[Any], Any] | None = None,
) -> Outcome:
    """Train; the result is the weights, the loss after each step and which
    shards each step used, the metrics the steps' rate
    (:func:`harness.loop_metrics`). ``stand_in``: seconds of sleep that replace
    each gradient's computation (:func:`scaled_gradient_stand_in`).
    ``convert``: applied to the shards and the initial weights where they are
    made (e.g. to torch tensors)."""
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
    if convert is not None:
        shards = [
            client.submit(convert, s, workers=[w]) for s, w in zip(shards, workers, strict=True)
        ]
        w_fut = client.submit(convert, w_fut, workers=[server])
    # The server's own copy of every shard, for the loss (not timed): made
    # there under keys of their own rather than fetched, since Dask's active
    # memory manager drops one of two copies of a key, sometimes the shard's
    # worker's, whose next gradient would then fetch it back inside a step.
    loss_shards = [
        client.submit(make_shard, i, samples, params, workers=[server], pure=False)
        for i in range(len(workers))
    ]
    if convert is not None:
        loss_shards = [client.submit(convert, s, workers=[server]) for s in loss_shards]
    wait([*shards, *loss_shards, w_fut])
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
        # timed; its own copies of the shards): computing it on the shards'
        # workers would move the weights there outside the timing.
        losses.append(
            sum(
                client.gather(
                    [client.submit(shard_loss, w_fut, s, workers=[server]) for s in loss_shards]
                )
            )
        )
    return Outcome(
        {"weights": w_fut.result(), "losses": losses, "used": used},
        loop_metrics(f"updates/s (k={k} of {len(workers)})", "first step, s", seconds),
        seconds,
    )


def reference(n: int, params: int, samples: int, used: list[list[int]], rate: float) -> Model:
    """The same training in this process with numpy alone, each step summing
    the gradients of the shards that step used."""
    shards = [make_shard(i, samples, params) for i in range(n)]
    w = zeros(params)
    for chosen in used:
        size = step_size(rate, len(chosen), samples, params)
        grads = [scaled_gradient(w, shards[i], size) for i in chosen]
        total = {f: np.sum([g[f] for g in grads], axis=0, dtype=np.float32) for f in w}
        w = apply_update(w, total)
    return w


def close(a: Model, b: Model, atol: float = 1e-4) -> bool:
    """Two models agree, field by field (numpy arrays or tensors)."""
    return a.keys() == b.keys() and all(
        np.allclose(np.asarray(a[f]), np.asarray(b[f]), atol=atol) for f in a
    )


def agree_with_numpy(n: int, params: int, samples: int, rate: float) -> Any:
    """Whether both trainings produced the weights numpy computes from the
    shards each one's steps used (with k < n the two may drop different
    gradients, so each is checked against its own)."""

    def agree(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return all(
            close(r["weights"], reference(n, params, samples, r["used"], rate)) for r in (a, b)
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


def main(argv: list[str] | None = None, convert: Callable[[Any], Any] | None = None) -> int:
    """The example; ``convert``: applied to the shards and the initial weights
    where they are made (``async_sgd_torch.py``: to torch tensors)."""
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
    title = (
        f"Parameter server: {mib:.0f} MiB of parameters in {len(FIELDS)} fields"
        f"{' (torch tensors)' if convert is not None else ''}, k = {k} of {args.workers} gradients"
    )
    print(f"{title}\n{describe(args)}\n", flush=True)
    outcomes = compare(
        args,
        lambda c, w: workload(
            c, w, args.params, args.samples, k, args.steps, args.rate, convert=convert
        ),
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
