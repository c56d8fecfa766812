"""A dask.array pipeline: a large operand used by every chunk, then a large reduction.

Ordinary dask.array code, unchanged with or without dask-hoplite::

    x = da.random.random((rows, d), chunks=(rows // n, d))   # one row block per worker
    y = x @ W                    # W (d x d, 64 MiB) is needed by every row block
    g = (y.T @ y).compute()      # each block's d x d Gram matrix, summed over blocks

``x @ W`` makes every worker fetch ``W`` (with dask-hoplite: one pipelined
broadcast); ``y.T @ y`` ends in a sum over the blocks' d x d partial products,
which Dask reduces in a tree of whole-object fetches and dask-hoplite, through
the graph rewrite, as one pipelined reduce tree over the partials where they
live.

    python examples/array_pipeline.py [--emulated] [--d 4096] [--rows-per-worker 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client, wait  # noqa: E402
from harness import Outcome, add_cluster_arguments, run_both  # noqa: E402


def make_w(d: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((d, d), dtype=np.float32) / np.float32(d)


def make_block(i: int, rows: int, d: int) -> np.ndarray:
    return np.random.default_rng(100 + i).random((rows, d), dtype=np.float32)


def arrays(client: Client, workers: list[str], d: int, rows: int) -> tuple[da.Array, da.Array]:
    """``x`` (one row block per worker, computed there) and ``W`` (on the first
    worker), persisted, as dask arrays."""
    blocks = [client.submit(make_block, i, rows, d, workers=[w]) for i, w in enumerate(workers)]
    w_fut = client.submit(make_w, d, workers=[workers[0]])
    wait([*blocks, w_fut])
    x = da.concatenate(
        [da.from_delayed(b, shape=(rows, d), dtype=np.float32) for b in blocks], axis=0
    )
    return x, da.from_delayed(w_fut, shape=(d, d), dtype=np.float32)


def pipeline(x: da.Array, w: da.Array) -> da.Array:
    y = x @ w
    return y.T @ y


def workload(client: Client, workers: list[str], d: int, rows: int) -> Outcome:
    x, w = arrays(client, workers, d, rows)
    t0 = time.perf_counter()
    gram = pipeline(x, w).compute()
    seconds = time.perf_counter() - t0
    return Outcome(gram, {"x @ W, then y.T @ y (s)": (seconds, False)})


def reference(n_workers: int, d: int, rows: int) -> np.ndarray:
    """The same Gram matrix computed in this process with numpy alone."""
    x = np.concatenate([make_block(i, rows, d) for i in range(n_workers)])
    y = x @ make_w(d)
    return y.T @ y


def agree(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-3, atol=1e-3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.add_argument("--d", type=int, default=4096, help="W is d x d float32 (4096: 64 MiB)")
    p.add_argument("--rows-per-worker", type=int, default=512)
    args = p.parse_args(argv)
    mib = args.d * args.d * 4 / 2**20
    title = f"dask.array: x @ W with W of {mib:.0f} MiB on {args.workers} row blocks, then y.T @ y"
    return run_both(args, title, lambda c, w: workload(c, w, args.d, args.rows_per_worker), agree)


if __name__ == "__main__":
    sys.exit(main())
