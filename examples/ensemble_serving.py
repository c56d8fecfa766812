"""Ensemble serving: every query's batch of images goes to every model of an ensemble.

An ensemble of image classifiers is held on the workers, one model per worker,
each model's weights loaded once and kept in its worker's memory as a Dask key.
A query is one batch of images (64 MiB of float32 by default) that every model
must see: the prediction tasks depend on the batch, so Dask moves it to every
model's worker (with dask-hoplite: as one pipelined broadcast instead of every
worker pulling a whole copy from the one holder). The answer combines the
predictions: the mean of the models' class probabilities, and its argmax per
image.

The models are random-feature classifiers with fixed seeded weights
(``relu(x @ W1) @ W2``, then a softmax): real matrix products, no framework.

Reports the latency of a query (queries one after another) and the throughput
with several queries in flight, with Dask alone and with dask-hoplite, and
whether the answers agree. (The Hoplite paper serves an ensemble of 8 models
with a 48 MiB input per query, 3.3x faster than on Ray.)

    python examples/ensemble_serving.py [--emulated] [--images 1365] [--queries 6]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from distributed import Client, Future, as_completed, wait  # noqa: E402
from harness import Outcome, add_cluster_arguments, run_both  # noqa: E402

IMAGE = (3, 64, 64)  # one image: 48 KiB of float32
HIDDEN = 256
CLASSES = 100


def load_model(seed: int) -> dict[str, np.ndarray]:
    """Model ``seed``'s weights (about 12.7 MB)."""
    rng = np.random.default_rng(seed)
    d = math.prod(IMAGE)
    w1 = rng.standard_normal((d, HIDDEN), dtype=np.float32) / np.float32(np.sqrt(d))
    w2 = rng.standard_normal((HIDDEN, CLASSES), dtype=np.float32) / np.float32(np.sqrt(HIDDEN))
    return {"w1": w1, "w2": w2}


def load_batch(query: int, n_images: int) -> np.ndarray:
    """Query ``query``'s images, as the frontend would decode them."""
    return np.random.default_rng(10_000 + query).random((n_images, *IMAGE), dtype=np.float32)


def predict(model: dict[str, np.ndarray], batch: np.ndarray) -> np.ndarray:
    """Class probabilities, one row per image."""
    hidden = np.maximum(batch.reshape(len(batch), -1) @ model["w1"], 0)
    logits = hidden @ model["w2"]
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def predict_stand_in(seconds: float, model: dict[str, np.ndarray], batch: np.ndarray) -> np.ndarray:
    """For the benchmark on a machine whose cores the emulated hosts share:
    uniform class probabilities of the right shape after ``seconds`` (the
    prediction's single-core time), the array's making included, instead of
    the computation. The examples never use it."""
    t0 = time.perf_counter()
    classes = model["w2"].shape[1]
    out = np.full((len(batch), classes), 1.0 / classes, dtype=np.float32)
    time.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
    return out


def combine(*probabilities: np.ndarray) -> dict[str, np.ndarray]:
    """The ensemble's answer: mean class probabilities and the label per image."""
    mean = np.mean(np.stack(probabilities), axis=0)
    return {"probabilities": mean, "labels": mean.argmax(axis=1)}


def answer(
    client: Client,
    models: list[Future],
    workers: list[str],
    query: int,
    n_images: int,
    predict_fn: Callable[..., np.ndarray] = predict,
) -> Future:
    """Submit one query: its batch on the first worker, one prediction per
    model on the model's worker, the combination."""
    batch = client.submit(load_batch, query, n_images, workers=[workers[0]], pure=False)
    preds = [
        client.submit(predict_fn, m, batch, workers=[w], pure=False)
        for m, w in zip(models, workers, strict=True)
    ]
    return client.submit(combine, *preds, workers=[workers[0]], pure=False)


def workload(
    client: Client,
    workers: list[str],
    n_images: int,
    queries: int,
    in_flight: int,
    stand_in: float | None = None,
) -> Outcome:
    """``stand_in``: seconds of sleep that replace each prediction's
    computation (:func:`predict_stand_in`)."""
    fn = predict if stand_in is None else functools.partial(predict_stand_in, stand_in)
    models = [client.submit(load_model, seed, workers=[w]) for seed, w in enumerate(workers)]
    wait(models)
    t0 = time.perf_counter()
    answer(client, models, workers, -1, n_images, fn).result()  # warm-up, not in the metrics
    cold = time.perf_counter() - t0
    latencies, answers = [], []
    for q in range(queries):
        t0 = time.perf_counter()
        answers.append(answer(client, models, workers, q, n_images, fn).result())
        latencies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    pending = as_completed(
        [answer(client, models, workers, q, n_images, fn) for q in range(in_flight)]
    )
    submitted = in_flight
    for _ in pending:
        if submitted < queries:
            pending.add(answer(client, models, workers, submitted, n_images, fn))
            submitted += 1
    throughput = queries / (time.perf_counter() - t0)
    return Outcome(
        answers,
        {
            "latency per query (s)": (statistics.median(latencies), False),
            f"queries/s, {in_flight} in flight": (throughput, True),
        },
        [cold, *latencies],
    )


def reference(n_models: int, n_images: int, queries: int) -> list[dict[str, np.ndarray]]:
    """The same answers computed in this process with numpy alone."""
    models = [load_model(seed) for seed in range(n_models)]
    return [combine(*(predict(m, load_batch(q, n_images)) for m in models)) for q in range(queries)]


def agree(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        np.allclose(x["probabilities"], y["probabilities"], rtol=1e-4, atol=1e-6)
        for x, y in zip(a, b, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.add_argument("--images", type=int, default=1365, help="images per query (48 KiB each)")
    p.add_argument("--queries", type=int, default=6)
    p.add_argument("--in-flight", type=int, default=4)
    args = p.parse_args(argv)
    mib = args.images * math.prod(IMAGE) * 4 / 2**20
    title = f"Ensemble serving: {args.workers} models, {mib:.0f} MiB of images per query"
    return run_both(
        args,
        title,
        lambda c, w: workload(c, w, args.images, args.queries, args.in_flight),
        agree,
    )


if __name__ == "__main__":
    sys.exit(main())
