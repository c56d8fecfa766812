"""Shared fixtures."""

from __future__ import annotations

import contextlib

import dask
import pytest
from distributed import Client, LocalCluster

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses

#: How many of the largest modules, classes and functions the run lists.
LARGEST_ROOMS = 5


def pytest_terminal_summary(terminalreporter):
    """The largest rooms of the house, at the end of every run: not a limit
    (a long module with one job is fine), a hint of where a seam may be."""
    from module_imports import modules, spans

    found = [sp for mod, path in modules().items() for sp in spans(path, mod)]
    terminalreporter.section("largest rooms (lines)")
    for kind, label in (("module", "modules"), ("class", "classes"), ("function", "functions")):
        top = sorted((sp for sp in found if sp.kind == kind), key=lambda sp: -sp.lines)
        rooms = ", ".join(f"{sp.name} {sp.lines}" for sp in top[:LARGEST_ROOMS])
        terminalreporter.write_line(f"{label}: {rooms}")


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
def process_workers(n: int = 3, config: dict | None = None, **cluster_kwargs):
    """``n`` worker processes (a real process boundary, e.g. to kill or stop
    one) with the plugin registered: yields (cluster, client). Other keyword
    arguments go to ``LocalCluster`` (a ``memory_limit``, say)."""
    with (
        dask.config.set(config or {}),
        LocalCluster(
            n_workers=n,
            threads_per_worker=1,
            processes=True,
            dashboard_address=":0",
            **cluster_kwargs,
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
