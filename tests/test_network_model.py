"""The measured network model that shapes reduce trees."""

from __future__ import annotations

import numpy as np
import pytest
from distributed import wait

from dask_hoplite.compat import worker_addresses
from dask_hoplite.core.network_model import (
    FALLBACK_BANDWIDTH,
    FALLBACK_LATENCY,
    MIN_SAMPLE_BYTES,
    NetworkModel,
)
from dask_hoplite.core.tree_shape import max_chain_length


def test_fallbacks_until_measured():
    est = NetworkModel().estimate()
    assert (est.bandwidth, est.latency, est.measured) == (
        FALLBACK_BANDWIDTH,
        FALLBACK_LATENCY,
        False,
    )


def test_medians_of_recent_samples_ignore_outliers_and_small_transfers():
    m = NetworkModel(window=5)
    m.observe_transfer(1000, 1e-6)  # tiny: says nothing about bandwidth
    for seconds in (1.0, 1.0, 1.1, 0.9, 50.0):  # one stalled stream
        m.observe_transfer(100 * MIN_SAMPLE_BYTES, seconds)
    for lat in (2e-4, 3e-4, 1.0):
        m.observe_latency(lat)
    est = m.estimate()
    assert est.measured
    assert est.bandwidth == pytest.approx(100 * MIN_SAMPLE_BYTES / 1.0)
    assert est.latency == pytest.approx(3e-4)
    # the window forgets old samples
    for _ in range(5):
        m.observe_transfer(MIN_SAMPLE_BYTES, 1.0)
    assert m.estimate().bandwidth == pytest.approx(MIN_SAMPLE_BYTES)


def test_configured_values_override_measurements():
    m = NetworkModel(bandwidth=1e9, latency=1e-5)
    m.observe_transfer(10 * MIN_SAMPLE_BYTES, 1.0)
    m.observe_latency(1.0)
    est = m.estimate()
    assert (est.bandwidth, est.latency) == (1e9, 1e-5)


def test_a_slow_network_makes_shorter_chains():
    fast, slow = NetworkModel(), NetworkModel()
    slow.observe_latency(0.05)  # 50 ms per hop
    size = 64 * 2**20
    k_fast = max_chain_length(size, fast.estimate().bandwidth, fast.estimate().latency)
    k_slow = max_chain_length(size, slow.estimate().bandwidth, slow.estimate().latency)
    assert k_slow < k_fast


def test_the_scheduler_learns_from_hoplite_streams(client):
    w = worker_addresses(client)
    x = client.submit(np.ones, 2 * MIN_SAMPLE_BYTES // 8, workers=[w[0]], pure=False)
    wait(x)
    y = client.submit(np.sum, x, workers=[w[1]], pure=False)
    assert y.result() == 2 * MIN_SAMPLE_BYTES // 8
    est = client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.handlers["hoplite_network"]()
    )
    assert est["measured"] is True
    assert est["bandwidth"] > 1e6 and 0 < est["latency"] < 1.0
