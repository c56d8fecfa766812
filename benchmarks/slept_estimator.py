"""A scikit-learn estimator whose compute is stood in by a sleep of its
measured single-core time, for ``real_clients.py --fit-compute sleep``.

The emulated cluster runs 8 worker hosts on the VM's 2 cores. A real fit
then takes its CPU from the hosts' transfers (the kernel's network path and
the relays), which a cluster of real hosts, each with cores of its own, does
not: in the CPU-bound regime (1 Gbit/s) a grid search's fits and X's tree
slow each other down. With ``SleptGaussianNB`` a fit task keeps its worker's
thread busy for the time the real ``GaussianNB`` fit and score take on one
core of this VM (measured before the run, by :func:`measure`), but leaves the
CPU to the transfers. Everything around the estimator stays real and
unchanged: joblib's Dask backend, ``GridSearchCV``, its split of X into the
folds (``X[train]``, a copy of half of X in every fit task) and the keys that
travel.

The fit and the score still compute, on every ``stride``-th row, so each
parameter value gets its own score and the search its best parameters, which
must be the same with and without the plugin.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from sklearn.naive_bayes import GaussianNB


class SleptGaussianNB(GaussianNB):
    """``GaussianNB`` fitted and scored on every ``stride``-th row, after a
    sleep of ``fit_seconds`` (fit) or ``score_seconds`` (score): the
    measured single-core time of the full-size call."""

    def __init__(
        self,
        *,
        priors: Any = None,
        var_smoothing: float = 1e-9,
        fit_seconds: float = 0.0,
        score_seconds: float = 0.0,
        stride: int = 64,
    ) -> None:
        super().__init__(priors=priors, var_smoothing=var_smoothing)
        self.fit_seconds = fit_seconds
        self.score_seconds = score_seconds
        self.stride = stride

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> SleptGaussianNB:
        time.sleep(self.fit_seconds)
        super().fit(X[:: self.stride], y[:: self.stride])
        return self

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        time.sleep(self.score_seconds)
        return float(super().score(X[:: self.stride], y[:: self.stride]))


def measure(X: Any, y: Any, repeats: int = 3) -> tuple[float, float]:
    """The median single-core seconds of ``GaussianNB().fit`` on one half of
    X and of ``score`` on the other half: what one fit task of a 2-fold search
    computes in the estimator (the split's copies are not counted; they stay
    real in the search)."""
    half = len(y) // 2
    X_train, y_train = X[:half].copy(), y[:half].copy()
    X_test, y_test = X[half:].copy(), y[half:].copy()
    fits, scores = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        est = GaussianNB().fit(X_train, y_train)
        t1 = time.perf_counter()
        est.score(X_test, y_test)
        t2 = time.perf_counter()
        fits.append(t1 - t0)
        scores.append(t2 - t1)
    return statistics.median(fits), statistics.median(scores)
