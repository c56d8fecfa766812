"""Shared fixtures."""

from __future__ import annotations

import contextlib

import dask
import pytest
from distributed import Client, LocalCluster

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses


@contextlib.contextmanager
def three_workers(config: dict | None = None):
    """A 3-worker in-process cluster over TCP with the plugin registered."""
    with (
        dask.config.set(config or {}),
        LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=False,
            protocol="tcp",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as c,
    ):
        c.wait_for_workers(3, timeout=30)
        c.register_plugin(dh.Hoplite())
        assert len(worker_addresses(c)) == 3
        yield c


@contextlib.contextmanager
def process_workers(n: int = 3):
    """``n`` worker processes (a real process boundary, e.g. to kill or stop
    one) with the plugin registered: yields (cluster, client)."""
    with (
        LocalCluster(
            n_workers=n, threads_per_worker=1, processes=True, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        c.register_plugin(dh.Hoplite())
        yield cluster, c


@pytest.fixture(scope="module")
def client():
    """:func:`three_workers`, shared by one module's tests (sync API)."""
    with three_workers() as c:
        yield c


@pytest.fixture
def client_without_stealing():
    """:func:`three_workers` where Dask never moves a task to an idle worker."""
    with three_workers({"distributed.scheduler.work-stealing": False}) as c:
        yield c


@pytest.fixture(scope="module")
def cluster_client():
    """3 in-process workers where reduction parts of at least 1 KiB take a
    reduce tree (for the dask.array and dask.bag rewrites), per module."""
    with (
        dask.config.set({"hoplite.min-bytes": "1 KiB"}),
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as cluster,
        Client(cluster) as c,
    ):
        c.register_plugin(dh.Hoplite())
        yield c
