"""Layers that never climb (issue 41): entry points route to the run shells,
the run shells drive the transport, and everything stands on the core. A lower
layer never imports a higher one, directly or through another module (read
with :mod:`ast`, nothing is run). A new module must be placed in a layer here.

Calls and callbacks are not imports: a lower layer that must tell a higher one
something takes a callable or a protocol it defines itself (the sender's
:class:`~dask_hoplite.worker.sender.StreamHooks`, say) and imports nothing of
the caller."""

from __future__ import annotations

from module_imports import climbs, import_graph, modules

#: Low to high. Each entry: a module, or a package and every module below it
#: (``pkg.*``).
LAYERS: dict[str, list[str]] = {
    # Pure decisions and the helpers every layer uses; namespace packages
    # whose __init__ imports nothing.
    "core": [
        "dask_hoplite.core",
        "dask_hoplite.core.*",
        "dask_hoplite._version",
        "dask_hoplite.errors",
        "dask_hoplite.config",
        "dask_hoplite.features",
        "dask_hoplite.compat",
        "dask_hoplite.patching",
        "dask_hoplite.timeouts",
        "dask_hoplite.logs",
        "dask_hoplite.prometheus",
        "dask_hoplite.worker",
        "dask_hoplite.scheduler",
        "dask_hoplite.dashboard",
        "dask_hoplite.graph_reductions",
        "dask_hoplite.graph_reductions.recognize",
        "dask_hoplite.graph_reductions.rewrite",
    ],
    # Moving bytes between workers: block streams, their sender and receiver,
    # and what a transfer writes into (the worker's context and accounting).
    "transport": [
        "dask_hoplite.worker.streams",
        "dask_hoplite.worker.sender",
        "dask_hoplite.worker.receiver",
        "dask_hoplite.worker.fetch_paths",
        "dask_hoplite.worker.context",
        "dask_hoplite.worker.accounting",
        "dask_hoplite.worker.timelines",
        "dask_hoplite.worker.prefault",
        "dask_hoplite.worker.memfd_regions",
        "dask_hoplite.worker.region_handoff",
        "dask_hoplite.worker.host_sharing",
        "dask_hoplite.worker.shared_pages",
        "dask_hoplite.worker.nanny_memory",
    ],
    # What runs a collective or serves one: the scheduler's coordinator and
    # services, the worker's run objects and services, the RPC helpers.
    "run shells": [
        "dask_hoplite.scheduler_calls",
        "dask_hoplite.scheduler.reduction_coordinator",
        "dask_hoplite.scheduler.first_ready",
        "dask_hoplite.scheduler.gc_paused",
        "dask_hoplite.scheduler.spares_used",
        "dask_hoplite.scheduler.cancellation",
        "dask_hoplite.scheduler.collective_log",
        "dask_hoplite.scheduler.directory_service",
        "dask_hoplite.scheduler.queries",
        "dask_hoplite.scheduler.peers",
        "dask_hoplite.scheduler.amm",
        "dask_hoplite.scheduler.replicate",
        "dask_hoplite.scheduler.prompt_stealing",
        "dask_hoplite.graph_reductions.scheduler_hook",
        "dask_hoplite.scheduler.measured_sizes",
        "dask_hoplite.scheduler.metrics",
        "dask_hoplite.worker.reductions",
        "dask_hoplite.worker.reduce_root",
        "dask_hoplite.worker.reduce_node",
        "dask_hoplite.worker.combine",
        "dask_hoplite.worker.tree_spreader",
        "dask_hoplite.worker.allreduce",
        "dask_hoplite.worker.small_allreduce",
        "dask_hoplite.worker.planned_reduce",
        "dask_hoplite.worker.planned_outputs",
        "dask_hoplite.graph_reductions.worker_takeover",
        "dask_hoplite.worker.running_tasks",
        "dask_hoplite.worker.partial_copies",
        "dask_hoplite.worker.measuring",
        "dask_hoplite.worker.metrics",
        "dask_hoplite.worker.progress",
        "dask_hoplite.dashboard.state",
        "dask_hoplite.dashboard.page",
    ],
    # What users and Dask call: the package, the collectives, the collective
    # tasks, the plugins' handler tables, the dashboard's routes.
    "entry points": [
        "dask_hoplite",
        "dask_hoplite.collectives",
        "dask_hoplite.collectives.*",
        "dask_hoplite.worker.tasks",
        "dask_hoplite.scheduler.plugin",
        "dask_hoplite.worker.plugin",
        "dask_hoplite.dashboard.live",
    ],
}


def ranks(known: dict[str, str], layers: dict[str, list[str]]) -> dict[str, int]:
    """module -> the index of its layer in ``layers``; every module of
    ``known`` that no entry names is missing."""
    out: dict[str, int] = {}
    for i, entries in enumerate(layers.values()):
        for entry in entries:
            if entry.endswith(".*"):
                out.update({m: i for m in known if m.startswith(entry[:-1])})
            else:
                out[entry] = i
    return out


def test_every_module_is_in_exactly_one_layer():
    known = modules()
    placed = [m for entries in LAYERS.values() for m in entries if not m.endswith(".*")]
    assert len(placed) == len(set(placed))
    assert set(placed) <= set(known), set(placed) - set(known)
    assert sorted(set(known) - set(ranks(known, LAYERS))) == []


def test_no_layer_imports_a_higher_one():
    known = modules()
    assert climbs(import_graph(known), ranks(known, LAYERS)) == []


def test_the_check_sees_a_climb_through_another_module(tmp_path):
    """``core.a`` imports nothing above it, but ``core.b`` which it imports
    does: that is a climb too, and so is a transport module importing the
    shells' package ``__init__`` that imports a shell."""
    pkg = tmp_path / "pkg"
    for d in ("core", "net", "shells"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("from pkg.core import b\n")
    (pkg / "core" / "b.py").write_text("def f():\n    from pkg.shells.run import R\n")
    (pkg / "shells" / "run.py").write_text("from pkg.net import stream\n")
    (pkg / "net" / "stream.py").write_text("import pkg.core.a\n")
    known = modules(str(pkg), "pkg")
    layers = {
        "core": ["pkg", "pkg.core", "pkg.core.*"],
        "transport": ["pkg.net", "pkg.net.*"],
        "run shells": ["pkg.shells", "pkg.shells.*"],
    }
    found = climbs(import_graph(known), ranks(known, layers))
    assert ["pkg.core.a", "pkg.core.b", "pkg.shells.run"] in found
    assert ["pkg.core.b", "pkg.shells.run"] in found
    assert ["pkg.net.stream", "pkg.core.a", "pkg.core.b", "pkg.shells.run"] in found
    (pkg / "core" / "b.py").write_text("")
    assert climbs(import_graph(modules(str(pkg), "pkg")), ranks(known, layers)) == []
