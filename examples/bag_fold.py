"""A dask.bag fold of arrays: per-partition feature sums combined into one.

Ordinary dask.bag code, unchanged with or without dask-hoplite::

    bag = db.from_delayed([load(i) for i in range(partitions)]).map(featurize)
    total = bag.fold(np.add).compute()      # a 64 MiB array of feature sums

Each partition folds its records into one array; Dask then combines the
partitions' arrays in a tree of whole-object fetches (``split_every=8``), which
dask-hoplite's graph rewrite runs as one pipelined reduce tree over the partial
results where they live.

    python examples/bag_fold.py [--emulated] [--features 16777216] [--records 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dask  # noqa: E402
import dask.bag as db  # noqa: E402
import numpy as np  # noqa: E402
from distributed import Client, wait  # noqa: E402
from harness import Outcome, add_cluster_arguments, run_both  # noqa: E402


def load(partition: int, records: int, features: int) -> list[np.ndarray]:
    """A partition's raw records."""
    rng = np.random.default_rng(partition)
    return [rng.standard_normal(features, dtype=np.float32) for _ in range(records)]


def featurize(record: np.ndarray) -> np.ndarray:
    return np.sqrt(np.abs(record)) * np.float32(2.0)


def make_bag(n_partitions: int, records: int, features: int) -> db.Bag:
    parts = [dask.delayed(load)(i, records, features) for i in range(n_partitions)]
    return db.from_delayed(parts).map(featurize)


def workload(client: Client, workers: list[str], records: int, features: int) -> Outcome:
    bag = make_bag(len(workers), records, features).persist()
    wait(bag)
    t0 = time.perf_counter()
    total = bag.fold(np.add).compute()
    return Outcome(total, {"bag.fold(np.add) (s)": (time.perf_counter() - t0, False)})


def reference(n_partitions: int, records: int, features: int) -> np.ndarray:
    """The same fold in this process with numpy alone."""
    return np.sum(
        [featurize(r) for i in range(n_partitions) for r in load(i, records, features)], axis=0
    )


def agree(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-4))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cluster_arguments(p)
    p.add_argument("--features", type=int, default=16 * 2**20, help="float32 per record")
    p.add_argument("--records", type=int, default=4, help="records per partition")
    args = p.parse_args(argv)
    mib = args.features * 4 / 2**20
    title = f"dask.bag: fold(np.add) of {mib:.0f} MiB arrays over {args.workers} partitions"
    return run_both(args, title, lambda c, w: workload(c, w, args.records, args.features), agree)


if __name__ == "__main__":
    sys.exit(main())
