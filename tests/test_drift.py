"""A release of distributed or dask that changes one private internal turns
off only the feature that needs it (``dask_hoplite.features``).

For each feature group, one of its internals drifts the way releases change
things (an optional keyword added to a method hoplite overrides, a parameter
renamed, a field removed, a dask function renamed), then a cluster starts with
the plugin. The cluster starts; that feature is off, with one WARNING and one
``hoplite`` event naming the internal and the feature; a broadcast, a reduce
and a dask.array sum give right results; every other feature is still on.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import dask
import dask.array as da
import dask.bag.core
import distributed.worker_state_machine as wsm
import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.active_memory_manager import ActiveMemoryManagerExtension
from distributed.core import ConnectionPool
from distributed.node import ServerNode
from distributed.scheduler import Scheduler
from distributed.worker import Worker

import dask_hoplite as dh
from dask_hoplite.features import FEATURES, TRANSPORT
from dask_hoplite.worker.context import PLUGIN_NAME

CONFIG = {"hoplite.min-bytes": "64 KiB", "hoplite.block-bytes": "64 KiB"}
ALL = set(FEATURES)


def _with_extra_keyword(cls: type, name: str) -> Any:
    """``cls.name`` as a release that added an optional keyword would have it."""
    original = getattr(cls, name)
    sig = inspect.signature(original)

    @functools.wraps(original)
    def method(*args: Any, hoplite_drift_test: Any = None, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    extra = inspect.Parameter("hoplite_drift_test", inspect.Parameter.KEYWORD_ONLY, default=None)
    params = list(sig.parameters.values())
    if params and params[-1].kind is inspect.Parameter.VAR_KEYWORD:
        params.insert(len(params) - 1, extra)
    else:
        params.append(extra)
    method.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def amethod(*args: Any, hoplite_drift_test: Any = None, **kwargs: Any) -> Any:
            return await original(*args, **kwargs)

        amethod.__signature__ = method.__signature__  # type: ignore[attr-defined]
        return amethod
    return method


def _with_renamed_parameter(cls: type, name: str, old: str, new: str) -> Any:
    """``cls.name`` with parameter ``old`` renamed ``new`` (Dask passes it
    positionally, so Dask itself still works)."""
    original = getattr(cls, name)
    sig = inspect.signature(original)

    @functools.wraps(original)
    def method(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    params = [p.replace(name=new) if p.name == old else p for p in sig.parameters.values()]
    method.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return method


@contextmanager
def _secede_event_without_a_field() -> Iterator[None]:
    fields = [
        (f.name, f.type, f)
        for f in dataclasses.fields(wsm.SecedeEvent)
        if f.name != "compute_duration"
    ]
    changed = dataclasses.make_dataclass("SecedeEvent", fields, bases=(wsm.StateMachineEvent,))
    with mock.patch.object(wsm, "SecedeEvent", changed):
        yield


@contextmanager
def _bag_helper_renamed() -> Iterator[None]:
    fn = dask.bag.core.empty_safe_aggregate
    with mock.patch.object(dask.bag.core, "empty_safe_aggregate_v2", fn, create=True):
        delattr(dask.bag.core, "empty_safe_aggregate")
        try:
            yield
        finally:
            dask.bag.core.empty_safe_aggregate = fn


def _patch(cls: type, name: str, value: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: mock.patch.object(cls, name, value())


#: feature -> (the internal that drifts, a context manager that drifts it)
DRIFTS: dict[str, tuple[str, Callable[[], Any]]] = {
    "transport": (
        "distributed.core.ConnectionPool.reuse",
        _patch(ConnectionPool, "reuse", lambda: _with_extra_keyword(ConnectionPool, "reuse")),
    ),
    "fetch": (
        "distributed.worker.Worker.gather_dep",
        _patch(Worker, "gather_dep", lambda: _with_extra_keyword(Worker, "gather_dep")),
    ),
    "replicate": (
        "distributed.scheduler.Scheduler.replicate",
        _patch(Scheduler, "replicate", lambda: _with_extra_keyword(Scheduler, "replicate")),
    ),
    "collectives": ("distributed.worker_state_machine.SecedeEvent", _secede_event_without_a_field),
    "amm-guard": (
        "distributed.active_memory_manager.ActiveMemoryManagerExtension._find_dropper",
        _patch(
            ActiveMemoryManagerExtension,
            "_find_dropper",
            lambda: _with_extra_keyword(ActiveMemoryManagerExtension, "_find_dropper"),
        ),
    ),
    "graph-reductions": ("dask.bag.core.empty_safe_aggregate", _bag_helper_renamed),
    "prompt-stealing": (
        "distributed.scheduler.Scheduler._get_prefix_duration",
        _patch(
            Scheduler,
            "_get_prefix_duration",
            lambda: _with_renamed_parameter(Scheduler, "_get_prefix_duration", "prefix", "tp"),
        ),
    ),
    "accounting": (
        "distributed.worker.Worker._get_cause",
        _patch(
            Worker,
            "_get_cause",
            lambda: _with_renamed_parameter(Worker, "_get_cause", "keys", "ks"),
        ),
    ),
    "dashboard": (
        "distributed.node.ServerNode._setup_logging",
        _patch(
            ServerNode,
            "_setup_logging",
            lambda: _with_renamed_parameter(ServerNode, "_setup_logging", "logger", "log"),
        ),
    ),
}


def test_every_feature_has_a_drift_test():
    assert set(DRIFTS) == ALL


def _installed(c: Client) -> dict[str, Any]:
    """What is installed on the scheduler and the workers, as seen from inside."""

    def look(dask_scheduler: Scheduler) -> dict[str, Any]:
        amm = dask_scheduler.extensions.get("amm")
        return {
            "directory": "hoplite_request" in dask_scheduler.handlers,
            "graph-rewrite": "_create_taskstate_from_graph" in vars(dask_scheduler),
            "replicate": "replicate" in vars(dask_scheduler),
            "amm-guard": amm is not None and "_find_dropper" in vars(amm),
            "prompt-stealing": dask_scheduler.plugins["hoplite"].prompt_stealing is not None,
        }

    def look_worker(dask_worker: Worker) -> dict[str, Any]:
        plugin = dask_worker.plugins.get(PLUGIN_NAME)
        return {
            "running": bool(plugin is not None and plugin.running),
            "fetch": "gather_dep" in vars(dask_worker),
            "replicate": getattr(dask_worker.handlers["gather"], "__self__", None)
            is not dask_worker,
        }

    return {"scheduler": c.run_on_scheduler(look), "workers": c.run(look_worker)}


def _check_results(c: Client) -> None:
    workers = sorted(c.scheduler_info()["workers"])
    x = c.submit(np.arange, 200_000, dtype="float64", workers=[workers[0]])
    copies = dh.broadcast(x, workers=workers)
    assert all(np.array_equal(v, np.arange(200_000.0)) for v in c.gather(copies))
    inputs = [
        c.submit(np.full, 50_000, i + 1.0, workers=[w], pure=False) for i, w in enumerate(workers)
    ]
    total = dh.reduce(inputs, op="sum").result()
    np.testing.assert_array_equal(total, np.full(50_000, float(sum(range(1, len(workers) + 1)))))
    arr = da.ones((400, 400), chunks=(100, 400))
    assert c.compute(arr.sum()).result() == 160_000


@pytest.mark.parametrize("feature", sorted(DRIFTS))
def test_a_drift_turns_off_only_its_feature(feature, caplog):
    internal, drift = DRIFTS[feature]
    with ExitStack() as stack:
        stack.enter_context(drift())
        stack.enter_context(dask.config.set(CONFIG))
        stack.enter_context(caplog.at_level(logging.WARNING, logger="dask_hoplite"))
        cluster = stack.enter_context(
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0")
        )
        c = stack.enter_context(Client(cluster))
        c.register_plugin(dh.Hoplite())  # the cluster starts, with the plugin
        warnings = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and "turns off its" in r.getMessage()
        ]
        # One warning for the feature, from each place that checks the
        # internal (the scheduler for its side, each worker for theirs).
        assert warnings and all(
            f"turns off its {feature} " in w and internal in w for w in warnings
        )
        where = {w.split(": ")[0].split(" on ")[-1] for w in warnings}
        assert len(where) == len(warnings), warnings  # one per place, not repeated
        events = [e for _, e in c.get_events("hoplite") if e.get("action") == "feature-off"]
        assert len(events) == len(warnings)
        assert all(e["feature"] == feature and e["internal"] == internal for e in events)

        installed = _installed(c)
        if feature == TRANSPORT:
            # Everything takes Dask's path: no worker runs hoplite (the
            # scheduler's directory has no sender to hand out).
            assert events[0]["also_off"] == sorted(ALL - {TRANSPORT})
            assert not any(v["running"] or v["fetch"] for v in installed["workers"].values())
            table = c.sync(c.scheduler.hoplite_features)
            assert len(table["workers"]) == 2, table
            assert all(on == [] for on in table["workers"].values()), table
        else:
            table = c.sync(c.scheduler.hoplite_features)
            expected = sorted(ALL - {feature})
            off_on_scheduler = feature not in table["scheduler"]["on"]
            if off_on_scheduler:
                assert table["scheduler"]["on"] == expected
            else:
                assert table["scheduler"]["on"] == sorted(ALL)
            assert all(on == expected for on in table["workers"].values()), table
            # What each feature installs is there exactly when it is on.
            sched, workers = installed["scheduler"], list(installed["workers"].values())
            assert sched["directory"]
            assert sched["graph-rewrite"] == (feature != "graph-reductions")
            assert sched["replicate"] == (feature != "replicate")
            assert sched["amm-guard"] == (feature != "amm-guard")
            assert sched["prompt-stealing"] == (feature != "prompt-stealing")
            assert all(w["running"] for w in workers)
            assert all(w["fetch"] == (feature != "fetch") for w in workers)
            assert all(w["replicate"] == (feature != "replicate") for w in workers)
        _check_results(c)


def test_a_worker_without_the_worker_part_gets_and_gives_keys_dasks_way():
    """A mixed cluster: the worker part fails to start on one worker (here a
    setup that raises; in life another dask-hoplite version). That worker is
    an outsider: the directory never hands it out as a sender, the keys it
    holds travel Dask's way, the collectives plan Dask's way while it is there,
    and everything gives right results."""
    from dask_hoplite.worker.plugin import HopliteWorker

    with ExitStack() as stack:
        stack.enter_context(dask.config.set(CONFIG))
        cluster = stack.enter_context(
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0")
        )
        c = stack.enter_context(Client(cluster))
        c.register_plugin(dh.Hoplite())
        assert c.sync(c.scheduler.get_metadata, keys=["dask-hoplite"], default=None) is not None

        async def refuse(self: Any, worker: Worker) -> None:
            raise RuntimeError("this worker part refuses to start")

        with mock.patch.object(HopliteWorker, "setup", refuse):
            cluster.scale(3)
            c.wait_for_workers(3, timeout=30)
        table = c.sync(c.scheduler.hoplite_features)
        outsider = next(a for a, on in table["workers"].items() if on is None)
        peers = sorted(a for a in table["workers"] if a != outsider)
        assert c.run_on_scheduler(
            lambda dask_scheduler: sorted(dask_scheduler.plugins["hoplite"].directory.outsiders)
        ) == [outsider]
        # Collectives: Dask's way while a worker lacks the part.
        assert c.sync(c.scheduler.get_metadata, keys=["dask-hoplite"], default=None) is None
        # A large key on the outsider reaches the peers (Dask's fetch).
        x = c.submit(np.arange, 200_000, dtype="float64", workers=[outsider])
        sums = [c.submit(np.sum, x, workers=[w], pure=False) for w in peers]
        assert c.gather(sums) == [float(np.arange(200_000.0).sum())] * 2
        streamed_from = c.run(
            lambda dask_worker: [
                t["sender"]
                for t in getattr(dask_worker.plugins.get(PLUGIN_NAME), "parts", None)
                and dask_worker.plugins[PLUGIN_NAME].parts.ctx.recent
                or []
            ],
            workers=peers,
        )
        assert all(outsider not in senders for senders in streamed_from.values())
        # A key on a peer reaches the outsider and the other peer.
        y = c.submit(np.arange, 200_000, dtype="float64", workers=[peers[0]])
        assert c.submit(np.sum, y, workers=[outsider]).result() == float(np.arange(200_000.0).sum())
        _check_results(c)
        # The outsider leaves: the collectives run hoplite's trees again.
        c.retire_workers([outsider])
        assert c.sync(c.scheduler.get_metadata, keys=["dask-hoplite"], default=None) is not None


def test_a_scheduler_side_transport_drift_leaves_dask_alone_everywhere(caplog):
    """The scheduler's side of the transport drifts (a parameter of
    ``Scheduler.register_worker_plugin``, which hoplite calls by keyword, is
    renamed): the scheduler part installs nothing and registers no worker
    part; the cluster runs on Dask's own transfers and gives right results."""
    drifted = _with_renamed_parameter(Scheduler, "register_worker_plugin", "idempotent", "once")
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(Scheduler, "register_worker_plugin", drifted))
        stack.enter_context(dask.config.set(CONFIG))
        stack.enter_context(caplog.at_level(logging.WARNING, logger="dask_hoplite"))
        cluster = stack.enter_context(
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0")
        )
        c = stack.enter_context(Client(cluster))
        c.register_plugin(dh.Hoplite())
        (warning,) = [r.getMessage() for r in caplog.records if "turns off its" in r.getMessage()]
        assert "turns off its transport" in warning and "on the scheduler" in warning
        assert "Scheduler.register_worker_plugin" in warning
        (event,) = [e for _, e in c.get_events("hoplite") if e.get("action") == "feature-off"]
        assert event["also_off"] == sorted(ALL - {TRANSPORT})
        installed = _installed(c)
        assert not any(installed["scheduler"].values())
        assert not any(w["running"] or w["fetch"] for w in installed["workers"].values())
        _check_results(c)
