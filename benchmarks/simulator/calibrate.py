"""Calibration of the simulator's overheads against measurements on the
emulated cluster (the JSON lists ``benchmarks/broadcast.py`` and
``benchmarks/reduce.py`` write), and the table of predicted against measured.

Entries used: ``op`` ``hoplite`` (the pipelined broadcast or reduce), ``dask``
(Dask's broadcast: every receiver pulls from the one holder) and ``dask-task``
(Dask's one-task reduce), of at least ``min_size`` bytes; the collective is the
entry's ``collective`` field, or else ``reduce`` if the file's name says so.
Measured seconds are the median of the warm repetitions.

Runs of one configuration (collective, op, N, size, rate) from several files
are pooled by :func:`pool`: their median is the one figure fitted and
compared. On the 2-core machine that emulates the cluster, one configuration
measured on different days spread by up to 55% (a 16-host reduce: 5.0 to
7.8 s), so a fit to single runs fits the day as much as the model.

Parameters are fitted (least squares on log(predicted / measured)) only where
the data can tell them apart: ``efficiency`` and ``hop_latency`` always;
``setup`` (a fixed cost per stream) only when hoplite was measured at two or
more cluster sizes: at one size, a fixed cost and ``(N - 1)`` hop latencies
are indistinguishable, and ``hop_latency`` then absorbs both (an upper bound).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from scipy.optimize import least_squares

from benchmarks.simulator.broadcast import Outcome, dask_broadcast, hoplite_broadcast
from benchmarks.simulator.params import Cluster, MiB, Overheads
from benchmarks.simulator.reduce import dask_reduce, hoplite_reduce

#: The operations the simulator models, by (collective, op).
MODELS: dict[tuple[str, str], Callable[[Cluster, int, float], Outcome]] = {
    ("broadcast", "hoplite"): hoplite_broadcast,
    ("broadcast", "dask"): dask_broadcast,
    ("reduce", "hoplite"): hoplite_reduce,
    ("reduce", "dask"): dask_reduce,
    ("reduce", "dask-task"): dask_reduce,
}


@dataclass(frozen=True)
class Measurement:
    source: str  # file name
    collective: str
    op: str
    n_workers: int
    size: int
    rate_mbit: float
    seconds: float
    #: Every run's seconds, when this entry pools several (see :func:`pool`).
    runs: tuple[float, ...] = ()

    @property
    def bound(self) -> float:
        return self.size / (self.rate_mbit * 1e6 / 8)


def load(paths: Iterable[str], min_size: int = 16 * MiB) -> list[Measurement]:
    """The entries of ``paths`` the simulator models."""
    out = []
    for path in paths:
        with open(path) as f:
            entries = json.load(f)
        name = os.path.basename(path)
        for e in entries:
            if not isinstance(e, dict) or "op" not in e or not e.get("ok", True):
                continue
            if int(e.get("workers_per_host", 1)) != 1:
                continue  # the simulator models one worker per host
            coll = e.get("collective") or ("reduce" if "reduce" in name else "broadcast")
            seconds = float(e.get("seconds", math.inf))
            if (coll, e["op"]) not in MODELS or e["size"] < min_size or not math.isfinite(seconds):
                continue
            out.append(
                Measurement(
                    name,
                    coll,
                    e["op"],
                    int(e["n_workers"]),
                    int(e["size"]),
                    float(e["rate_mbit"]),
                    seconds,
                )
            )
    return out


def pool(data: list[Measurement]) -> list[Measurement]:
    """One entry per configuration (collective, op, N, size, rate), in the
    order first seen: the median of its runs' seconds, every run kept in
    ``runs``, and the files they came from joined in ``source``."""
    groups: dict[tuple[str, str, int, int, float], list[Measurement]] = {}
    for m in data:
        groups.setdefault((m.collective, m.op, m.n_workers, m.size, m.rate_mbit), []).append(m)
    out = []
    for (collective, op, n, size, rate), ms in groups.items():
        runs = tuple(m.seconds for m in ms)
        sources = ",".join(dict.fromkeys(m.source for m in ms))
        out.append(
            Measurement(sources, collective, op, n, size, rate, statistics.median(runs), runs)
        )
    return out


def predict(m: Measurement, overheads: Overheads) -> float:
    cluster = Cluster(m.rate_mbit * 1e6 / 8, overheads)
    return MODELS[m.collective, m.op](cluster, m.n_workers, m.size).seconds


def fitted(data: list[Measurement], workers: Collection[int] | None = None) -> list[Measurement]:
    """The entries of ``data`` that :func:`fit` fits: hoplite's (Dask's only
    if there are none), of ``workers`` hosts only if given."""
    if workers is not None:
        data = [m for m in data if m.n_workers in workers]
        if not any(m.op == "hoplite" for m in data):
            raise ValueError(f"no hoplite measurement at N = {sorted(workers)} to fit")
    return [m for m in data if m.op == "hoplite"] or data


def fit(
    data: list[Measurement],
    start: Overheads | None = None,
    workers: Collection[int] | None = None,
) -> tuple[Overheads, list[str]]:
    """The overheads that fit ``data``'s hoplite entries best (those of
    ``workers`` hosts only, if given), and the names of those fitted. Dask's
    entries are predicted, not fitted: the star model is an upper bound for
    Dask (its receivers also fetch from receivers that finished), and fitting
    it would pull the overheads away from hoplite's."""
    start = start or Overheads()
    data = fitted(data, workers)
    sizes = {m.n_workers for m in data if m.op == "hoplite"}
    names = ["efficiency", "hop_latency"] + (["setup"] if len(sizes) > 1 else [])
    if not data:
        return start, []
    x0 = [getattr(start, k) for k in names]
    lo = {"efficiency": 0.3, "hop_latency": 0.0, "setup": 0.0}
    hi = {"efficiency": 1.0, "hop_latency": 0.2, "setup": 1.0}

    def residuals(x: list[float]) -> list[float]:
        o = Overheads(**{**vars(start), **dict(zip(names, x, strict=True))})
        return [math.log(predict(m, o) / m.seconds) for m in data]

    res = least_squares(
        residuals,
        x0,
        bounds=([lo[k] for k in names], [hi[k] for k in names]),
        diff_step=1e-3,
    )
    best = Overheads(**{**vars(start), **dict(zip(names, map(float, res.x), strict=True))})
    return best, names


@dataclass(frozen=True)
class Row:
    m: Measurement
    predicted: float

    @property
    def error(self) -> float:
        """Predicted relative to measured, in percent."""
        return (self.predicted / self.m.seconds - 1) * 100


def compare(data: list[Measurement], overheads: Overheads) -> list[Row]:
    return [Row(m, predict(m, overheads)) for m in data]
