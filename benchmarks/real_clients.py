"""Unchanged third-party code on the emulated cluster, with and without
dask-hoplite, in the same run.

Workloads (each on a fresh Dask cluster per method, over the same emulated
network; the client runs on the scheduler's host):

* ``gridsearch``: scikit-learn's ``GridSearchCV`` on joblib's Dask backend,
  X of ``--x-bytes`` (float64) and its labels made in the client, 16 fits
  (8 parameter values x 2 folds) on 8 workers, ``GaussianNB`` (a cheap fit:
  the search is about moving X). joblib scatters X, y and the fold indices
  to one worker per search, and every fit task needs them. Beside it:
  ``client.scatter(X)`` alone, in the same cluster; and the same search with
  X and y already on every worker (``parallel_backend("dask", scatter=[X,
  y])``), in a fresh cluster with the active memory manager off (on, it drops
  the replicas no task holds). The bound for a search is the p50 of those
  two plus 1.3 S/B (X broadcast to the other workers). With ``--fit-compute
  sleep`` the estimator's fit and score sleep their measured single-core
  time instead of computing (``benchmarks/slept_estimator.py``), so the
  emulated hosts' fits do not take the VM's 2 cores from their transfers.
* ``merge``: a dask.dataframe of 16 partitions merged with a table of
  ``--table-bytes`` that a task makes in one partition: Dask broadcasts the
  single partition to every partition's merge task. Bound: S/B.
* ``model``: a fitted scikit-learn ``KNeighborsClassifier`` (brute force: it
  keeps its training data, ``--model-bytes`` of it) made by a task on one
  worker and used by a predict task on every other. Dask sizes it at 56
  bytes (``sizeof`` has no rule for it): dask-hoplite measures it serialised.
  Bound: S/B.

Every time is a ratio to S/B of the object that travels (X, the table, the
model), with Dask's default from the same run. p50, p90 and max over the warm
repetitions, beside the cold first one.

    sudo python benchmarks/real_clients.py --workers 8 --rate-mbit 250 --workloads gridsearch merge model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dask.utils import format_bytes, parse_bytes  # noqa: E402

from benchmarks.broadcast import quantile, worker_env  # noqa: E402
from benchmarks.emulation import EmulatedCluster  # noqa: E402

WORKLOADS = ("gridsearch", "merge", "model")
METHODS = ("dask", "hoplite")
#: Parameter values of the grid search; with 2 folds, 16 fits.
GRID = [1e-9 * 10**i for i in range(8)]


@dataclass
class Row:
    op: str  # "<method>-<workload>[-<variant>]"
    n_workers: int
    size: int  # bytes of the object that travels
    rate_mbit: float
    all_seconds: list[float]  # the first one cold
    bound_seconds: float
    ok: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------ on the workers


def make_table(nbytes: int, seed: int) -> Any:
    """The right side of the merge: ``nbytes`` of int64 columns, keyed 0..n-1."""
    import numpy as np
    import pandas as pd

    rows = nbytes // 32
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "k": np.arange(rows, dtype=np.int64),
            "a": rng.integers(0, 2**62, rows),
            "b": rng.integers(0, 2**62, rows),
            "c": rng.integers(0, 2**62, rows),
        }
    )


def make_left(i: int, rows: int, keys: int) -> Any:
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(i)
    return pd.DataFrame({"k": rng.integers(0, keys, rows), "v": np.full(rows, i)})


def fit_model(nbytes: int, seed: int) -> Any:
    """A fitted k-nearest-neighbours model keeping ``nbytes`` of training data."""
    import numpy as np
    from sklearn.neighbors import KNeighborsClassifier

    d = 32
    n = nbytes // (8 * d)
    rng = np.random.default_rng(seed)
    return KNeighborsClassifier(n_neighbors=3, algorithm="brute").fit(
        rng.random((n, d)), rng.integers(0, 2, n)
    )


def predict(model: Any, i: int) -> list[int]:
    import numpy as np

    q = np.random.default_rng(1000 + i).random((4, model.n_features_in_))
    return [int(v) for v in model.predict(q)]


# ------------------------------------------------------------ the workloads


def _time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _search_data(x_bytes: int) -> tuple[Any, Any]:
    """X (``x_bytes`` of float64, 32 features) and 4 labels, made in the client.
    At 256 MiB: a million rows, so y is 8 MiB and each fold's indices 4 MiB,
    several large keys beside X, as in a search on real data."""
    import numpy as np

    d = 32
    rows = x_bytes // (8 * d)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, rows)
    return rng.random((rows, d)) + y[:, None] * 0.01, y


def _search(X: Any, y: Any, estimator: Any) -> dict[str, Any]:
    from sklearn.model_selection import GridSearchCV

    gs = GridSearchCV(estimator, {"var_smoothing": GRID}, cv=2, n_jobs=-1)
    gs.fit(X, y)
    return {"best_params": gs.best_params_, "best_score": float(gs.best_score_)}


def gridsearch(
    client: Any, reps: int, x_bytes: int, tag: str, n: int, rate: float, estimator: Any
) -> list[Row]:
    """Searches as a user runs them (joblib scatters X, y and the folds for
    each), then ``client.scatter(X)`` alone."""
    import joblib

    X, y = _search_data(x_bytes)
    times, best = [], []
    with joblib.parallel_backend("dask"):
        for _ in range(reps + 1):
            dt, out = _time(lambda: _search(X, y, estimator))
            times.append(dt)
            best.append(out)
            print(f"#   {tag} search: {dt:.2f} s {out}", flush=True)
    scat = []
    for _ in range(reps + 1):
        dt, fut = _time(lambda: client.scatter(X, hash=False))
        scat.append(dt)
        del fut
        time.sleep(0.5)
    same = all(b["best_params"] == best[0]["best_params"] for b in best)
    bound = X.nbytes / rate
    return [
        Row(f"{tag}-gridsearch", n, X.nbytes, 0, times, bound, same, extra={"best": best}),
        Row(f"{tag}-scatter", n, X.nbytes, 0, scat, bound),
    ]


def prescattered(
    client: Any, reps: int, x_bytes: int, tag: str, n: int, rate: float, estimator: Any
) -> list[Row]:
    """The same search with X and y already on every worker (joblib's
    ``scatter=``, a broadcast scatter, done before timing): what the search
    costs without moving X. Run on a cluster with the active memory manager
    off, which would otherwise drop the replicas no task holds."""
    import joblib

    X, y = _search_data(x_bytes)
    times = []
    with joblib.parallel_backend("dask", scatter=[X, y]):
        for _ in range(reps + 1):
            dt, _out = _time(lambda: _search(X, y, estimator))
            times.append(dt)
    return [Row(f"{tag}-gridsearch-prescattered", n, X.nbytes, 0, times, X.nbytes / rate)]


def merge(client: Any, reps: int, table_bytes: int, tag: str, n: int, rate: float) -> list[Row]:
    import dask
    import dask.dataframe as dd
    from distributed import wait

    table_rows = table_bytes // 32
    times = []
    sums = []
    for rep in range(reps + 1):
        right = dd.from_delayed([dask.delayed(make_table)(table_bytes, rep)], verify_meta=False)
        # Made on one worker before timing starts, as a table read or computed earlier is.
        right = right.persist()
        wait(right)
        left = dd.from_map(make_left, range(16), rows=20_000, keys=table_rows)
        joined = left.merge(right, on="k", how="inner")
        dt, total = _time(lambda joined=joined: int(joined["a"].sum().compute()))
        times.append(dt)
        sums.append(total)
        del right, left, joined
        time.sleep(0.5)
    size = (table_bytes // 32) * 32
    return [Row(f"{tag}-merge", n, size, 0, times, size / rate, extra={"sums": sums})]


def model(client: Any, reps: int, model_bytes: int, tag: str, n: int, rate: float) -> list[Row]:
    from distributed import wait

    from dask_hoplite.compat import worker_addresses

    workers = worker_addresses(client)
    src, others = workers[0], workers[1:]
    times, answers = [], []
    for rep in range(reps + 1):
        m = client.submit(fit_model, model_bytes, rep, workers=[src], pure=False)
        wait(m)
        dt, got = _time(
            lambda m=m: client.gather(
                [
                    client.submit(predict, m, i, workers=[w], allow_other_workers=False, pure=False)
                    for i, w in enumerate(others)
                ]
            )
        )
        times.append(dt)
        answers.append(got)
        del m
        time.sleep(0.5)
    size = (model_bytes // (8 * 32)) * 8 * 32
    return [Row(f"{tag}-model", n, size, 0, times, size / rate, extra={"answers": answers})]


RUNNERS = {
    "gridsearch": gridsearch,
    "prescattered": prescattered,
    "merge": merge,
    "model": model,
}


def run(ec: EmulatedCluster, workload: str, method: str, args: argparse.Namespace) -> list[Row]:
    from distributed import Client

    import dask_hoplite

    env = worker_env(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    if workload == "prescattered":
        env["DASK_DISTRIBUTED__SCHEDULER__ACTIVE_MEMORY_MANAGER__START"] = "False"
    ec.start_dask(env=env)
    size = {
        "gridsearch": args.x_bytes,
        "prescattered": args.x_bytes,
        "merge": args.table_bytes,
        "model": args.model_bytes,
    }
    try:
        with Client(ec.scheduler_address, timeout=60) as client:
            if method == "hoplite":
                client.register_plugin(dask_hoplite.Hoplite())
            searches = workload in ("gridsearch", "prescattered")
            rows = RUNNERS[workload](
                client,
                args.reps,
                size[workload],
                method,
                ec.n_workers,
                ec.rate_bytes_per_s,
                **({"estimator": args.estimator} if searches else {}),
            )
            if searches and args.fit_seconds is not None:
                fit, score = args.fit_seconds
                for r in rows:
                    r.note = f"fit+score slept {fit:.2f}+{score:.2f} s"
                    r.extra["fit_seconds"], r.extra["score_seconds"] = fit, score
            if method == "hoplite":
                # Whether the keys went through hoplite at all: its counts, summed.
                stats = client.run(lambda dask_worker: dask_worker.plugins["hoplite-worker"].stats)
                for name in ("keys-received", "keys-measured", "local-hits"):
                    rows[0].extra[name] = sum(s.get(name, 0) for s in stats.values())
    finally:
        ec.stop_dask()
    for r in rows:
        r.rate_mbit = ec.rate_mbit
    return rows


def print_table(rows: list[Row]) -> None:
    base = {r.op.split("-", 1)[1]: r for r in rows if r.op.startswith("dask-")}
    hdr = (
        f"{'op':<34} {'N':>3} {'S':>10} {'rate':>9} {'S/B s':>6} {'warm':>4} "
        f"{'cold':>5} {'p50':>5} {'p90':>5} {'max':>5} {'x dask':>6}  note"
    )
    print(hdr)
    print(f"{'':<34} {'':>3} {'':>10} {'':>9} {'':>6} {'':>4} (each x S/B)")
    print("-" * len(hdr))
    for r in rows:
        b, warm = r.bound_seconds, r.all_seconds[1:]
        twin = base.get(r.op.split("-", 1)[1])
        vs = quantile(warm, 0.5) / quantile(twin.all_seconds[1:], 0.5) if twin else float("nan")
        print(
            f"{r.op:<34} {r.n_workers:>3} {format_bytes(r.size):>10} {r.rate_mbit:>6.0f}Mb/s "
            f"{b:>6.2f} {len(warm):>4} {r.all_seconds[0] / b:>5.2f} "
            f"{quantile(warm, 0.5) / b:>5.2f} {quantile(warm, 0.9) / b:>5.2f} "
            f"{quantile(warm, 1.0) / b:>5.2f} {vs:>6.2f}  {r.note}{'' if r.ok else ' FAILED'}"
            + "".join(f" {k}={v}" for k, v in r.extra.items() if k.startswith(("keys", "local")))
        )
    by_op = {r.op: r for r in rows}
    for tag in METHODS:
        s, pre, scat = (
            by_op.get(f"{tag}-gridsearch"),
            by_op.get(f"{tag}-gridsearch-prescattered"),
            by_op.get(f"{tag}-scatter"),
        )
        if s and pre and scat:
            b = s.bound_seconds
            limit = quantile(pre.all_seconds[1:], 0.5) + quantile(scat.all_seconds[1:], 0.5)
            limit += 1.3 * b
            got = quantile(s.all_seconds[1:], 0.5)
            print(
                f"{tag} search p50 {got:.2f} s; X on every worker + scatter(X) + 1.3 S/B = "
                f"{limit:.2f} s: {'within' if got <= limit else 'OVER'}"
            )
    bests = {
        r.op: [b["best_params"] for b in r.extra["best"]]
        for r in rows
        if r.op.endswith("-gridsearch") and "best" in r.extra
    }
    if len(bests) == 2:
        a, b = bests.values()
        print(f"best parameters identical with and without the plugin: {a == b} ({a[0]})")


def _estimator(args: argparse.Namespace) -> tuple[Any, tuple[float, float] | None]:
    """The search's estimator, and with ``--fit-compute sleep`` the fit's and
    the score's measured single-core seconds that it sleeps."""
    if "gridsearch" not in args.workloads:
        return None, None
    if args.fit_compute == "real":
        from sklearn.naive_bayes import GaussianNB

        return GaussianNB(), None
    from benchmarks import slept_estimator

    fit, score = slept_estimator.measure(*_search_data(args.x_bytes))
    print(f"# single-core GaussianNB on half of X: fit {fit:.3f} s, score {score:.3f} s")
    return slept_estimator.SleptGaussianNB(fit_seconds=fit, score_seconds=score), (fit, score)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--rate-mbit", type=float, default=250)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--reps", type=int, default=10, help="warm repetitions after one cold one")
    p.add_argument("--x-bytes", type=parse_bytes, default="256MiB")
    p.add_argument("--table-bytes", type=parse_bytes, default="64MiB")
    p.add_argument("--model-bytes", type=parse_bytes, default="64MiB")
    p.add_argument(
        "--fit-compute",
        choices=("real", "sleep"),
        default="real",
        help="the search's estimator: GaussianNB computing (real), or its fit and score "
        "stood in by a sleep of their single-core time measured before the run (sleep; "
        "benchmarks/slept_estimator.py: on 2 cores a real fit takes the CPU the emulated "
        "hosts' transfers need)",
    )
    p.add_argument("--out", default="benchmarks/results/real-clients")
    args = p.parse_args(argv)
    args.estimator, args.fit_seconds = _estimator(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows: list[Row] = []
    with EmulatedCluster(args.workers, rate_mbit=args.rate_mbit) as ec:
        ec.enter_namespace("sched")
        for workload in args.workloads:
            for method in args.methods:
                got = run(ec, workload, method, args)
                if workload == "gridsearch":
                    got += run(ec, "prescattered", method, args)
                for r in got:
                    print(f"# {r.op}: {[round(t, 3) for t in r.all_seconds]}", flush=True)
                rows += got
    print()
    print_table(rows)
    with open(args.out + ".json", "w") as f:
        json.dump([asdict(r) for r in rows], f, indent=1, default=str)
    print(f"\nwrote {args.out}.json")
    for w, field_ in (("merge", "sums"), ("model", "answers")):
        answers = [r.extra[field_] for r in rows if r.op.endswith(f"-{w}")]
        if len(answers) == 2:
            same = answers[0] == answers[1]
            print(f"{w}: the results with and without the plugin are the same: {same}")
            if not same:
                return 1
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
