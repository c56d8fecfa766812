"""Every private internal of ``distributed`` and ``dask`` that dask-hoplite
touches, the feature that needs each, and the releases it is tested against.

The worker part overrides or calls internals such as ``Worker.gather_dep``, the
``GatherDep*Event`` classes, ``worker.state.tasks``, the Active Memory
Manager's ``_find_dropper`` and ``Scheduler._create_taskstate_from_graph``.
They have been stable for years, but a release could change them silently, so:

* :data:`PRIVATE_INTERNALS` names each internal, the feature of
  :mod:`dask_hoplite.features` that needs it, where it is used and what
  dask-hoplite relies on (its existence, the parameters it is called with or
  overridden by);
* :func:`find_drifts` checks them against a live worker or scheduler when the
  plugin starts there: an internal that changed turns off only its feature
  (the plugins log one warning and one ``hoplite`` event for it), never the
  start of the scheduler or the worker;
* :func:`check_internals` raises naming every changed internal
  (``tests/test_compat.py`` runs it on every release the suite runs on);
* :data:`TESTED_RANGE` is the releases the suite passed on. The plugin refuses
  a distributed older than its lower bound (the package requires it too) and
  warns on one newer than its upper bound, that it is untested there: the
  checks above are the safety net.

It also holds the workarounds for behaviour of the tested releases that
dask-hoplite must not rely on (:func:`worker_addresses`).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import distributed
from packaging.version import Version

from dask_hoplite.errors import UnsupportedDistributed
from dask_hoplite.features import (
    ACCOUNTING,
    AMM_GUARD,
    COLLECTIVES,
    DASHBOARD,
    FETCH,
    GRAPH_REDUCTIONS,
    PROMPT_STEALING,
    REPLICATE,
    TRANSPORT,
    Drift,
)

__all__ = [
    "PRIVATE_INTERNALS",
    "TESTED_RANGE",
    "Internal",
    "UnsupportedDistributed",
    "check_distributed_version",
    "check_internals",
    "find_drifts",
    "private",
    "worker_addresses",
]

#: The oldest and the newest release of distributed the test suite passed on
#: (both included; the CI runs the oldest and the newest, docs/compatibility.md
#: has the whole matrix). pyproject's lower bound is the first.
TESTED_RANGE = (Version("2025.12.0"), Version("2026.8.0"))


@dataclass(frozen=True)
class Internal:
    """One private internal dask-hoplite relies on.

    ``feature``: the feature of :mod:`dask_hoplite.features` that needs it
    (set by the group it is listed in).
    ``path``: dotted path, a module then attributes (``distributed.worker.Worker.gather_dep``);
    the attributes after a class may be instance attributes, resolved on a
    live instance when one is given. ``params``: for a callable, the
    parameter names dask-hoplite passes or overrides with, in order (``self``
    excluded); ``exact``: the callable's parameters must be exactly these
    (an override must accept everything Dask passes). ``fields``: for a
    dataclass, the fields dask-hoplite reads or builds it with.
    """

    path: str
    used_by: str
    why: str
    params: tuple[str, ...] | None = None
    exact: bool = False
    fields: tuple[str, ...] | None = None
    feature: str = TRANSPORT

    @property
    def side(self) -> str:
        """Where it is checked: "scheduler" (the scheduler and AMM, dask's
        graph internals the rewrite reads) or "worker" (everything else)."""
        scheduler = (
            "distributed.scheduler.",
            "distributed.active_memory_manager.",
            "distributed.stealing.",
            "dask.",
        )
        return "scheduler" if self.path.startswith(scheduler) else "worker"


def _feature(feature: str, *internals: Internal) -> tuple[Internal, ...]:
    return tuple(dataclasses.replace(i, feature=feature) for i in internals)


_W = "distributed.worker.Worker"
_WSM = "distributed.worker_state_machine"
_S = "distributed.scheduler.Scheduler"
_ST = "distributed.stealing.WorkStealing"

PRIVATE_INTERNALS: tuple[Internal, ...] = (
    # ---- the transport: comms, the connection pool, the directory's handlers and task states
    *_feature(TRANSPORT,
        Internal(f"{_W}.batched_send", "worker/context.py", "sends hoplite-finished/-released", ("msg",)),
        Internal(f"{_W}.batched_stream", "worker/context.py", "checked open before sending"),
        Internal(f"{_W}.periodic_callbacks", "worker/plugin.py", "the buffer pool's trim callback"),
        Internal(f"{_W}.latency", "worker/receiver.py", "reported to the network model"),
        Internal(f"{_W}.rpc", "worker/streams.py", "the worker's ConnectionPool for block streams"),
        Internal(f"{_W}.state.tasks", "worker/context.py", "a key's nbytes and state on the worker"),
        Internal(f"{_WSM}.WorkerState.tasks", "worker/context.py", "per-key TaskState"),
        Internal(f"{_WSM}.TaskState.nbytes", "worker/context.py", "decides which keys are large"),
        Internal("distributed.worker.get_data_from_worker", "worker/receiver.py", "fallback fetch of a part",
                 ("rpc", "keys", "worker", "who")),
        Internal("distributed.core.ConnectionPool.connect", "worker/streams.py", "opens block-stream comms", ("addr",)),
        Internal("distributed.core.ConnectionPool.reuse", "worker/streams.py", "gives comms back", ("addr", "comm"), exact=True),
        Internal("distributed.comm.tcp.TCP.stream", "worker/streams.py", "raw mode reads/writes the tornado stream"),
        Internal(f"{_S}.handlers", "scheduler/plugin.py", "hoplite's RPCs and the replicate override"),
        Internal(f"{_S}.stream_handlers", "scheduler/plugin.py", "hoplite-finished/-released"),
        Internal(f"{_S}.register_worker_plugin", "scheduler/plugin.py", "installs the worker part",
                 ("comm", "plugin", "name", "idempotent")),
        Internal(f"{_S}.tasks", "scheduler/plugin.py", "a key's TaskState"),
        Internal(f"{_S}.host_info", "scheduler/plugin.py", "the hosts with workers: a chain's deepest"),
        Internal("distributed.scheduler.TaskState.state", "scheduler", "memory, released, erred..."),
        Internal("distributed.scheduler.TaskState.nbytes", "scheduler", "decides which keys are large"),
        Internal("distributed.scheduler.TaskState.who_has", "scheduler", "holders of a key"),
        Internal("distributed.scheduler.TaskState.processing_on", "scheduler/queries.py", "where a task runs"),
    ),
    # ---- the transparent fetch of large keys
    *_feature(FETCH,
        Internal(f"{_W}.gather_dep", "worker/fetch_paths.py", "replaced on the instance to take large keys",
                 ("worker", "to_gather", "total_nbytes", "stimulus_id"), exact=True),
        Internal(f"{_W}.state.log", "worker/fetch_paths.py", "hoplite's receive events in the worker's log"),
        Internal(f"{_WSM}.GatherDepSuccessEvent", "worker/fetch_paths.py", "returned by the gather_dep override",
                 fields=("stimulus_id", "worker", "total_nbytes", "data")),
        Internal("distributed.worker.WORKER_ANY_RUNNING", "worker/fetch_paths.py", "worker statuses that fetch"),
        Internal(f"{_W}.transfer_outgoing_count_limit", "worker/sender.py",
                 "Dask's limit on transfers out, which hoplite's streams count against"),
    ),
    # ---- pipelined replicate and scatter(broadcast=True)
    *_feature(REPLICATE,
        Internal(f"{_W}.gather", "worker/fetch_paths.py", "worker.handlers['gather'] is wrapped (replicate, scatter broadcast)",
                 ("who_has",), exact=True),
        Internal(f"{_W}.update_data", "worker/fetch_paths.py", "stores what the gather endpoint fetched",
                 ("data", "stimulus_id")),
        Internal(f"{_S}.replicate", "scheduler/replicate.py", "replaced on the instance (scatter broadcast)",
                 ("keys", "n", "workers", "branching_factor", "delete", "stimulus_id"), exact=True),
        Internal(f"{_S}._replica_lock", "scheduler/replicate.py", "serialises replicate with the AMM"),
        Internal(f"{_S}.gather_on_worker", "scheduler/replicate.py", "asks a worker to fetch replicas",
                 ("worker_address", "who_has")),
        Internal(f"{_S}.delete_worker_data", "scheduler/replicate.py", "drops excess replicas",
                 ("worker_address", "keys", "stimulus_id")),
        Internal(f"{_S}.workers_list", "scheduler/replicate.py", "resolves replicate's workers", ("workers",)),
        Internal(f"{_S}.workers", "scheduler/replicate.py", "WorkerState by address"),
        Internal(f"{_S}.running", "scheduler/replicate.py", "the running workers (replicate's pool)"),
        Internal("distributed.scheduler.WorkerState.status", "scheduler/replicate.py", "running or not"),
    ),
    # ---- the explicit collectives
    *_feature(COLLECTIVES,
        Internal(f"{_WSM}.SecedeEvent", "worker/small_allreduce.py", "a coroutine task leaves its thread slot",
                 fields=("stimulus_id", "key", "compute_duration")),
        Internal(f"{_S}.stream_comms", "scheduler/cancellation.py", "stops a cancelled collective on its worker"),
        Internal(f"{_W}.stream_handlers", "worker/running_tasks.py", "hoplite-cancel, from the scheduler part"),
    ),
    # ---- the AMM guard
    *_feature(AMM_GUARD,
        Internal(f"{_S}.extensions", "scheduler/amm.py", "finds the Active Memory Manager"),
        Internal("distributed.active_memory_manager.ActiveMemoryManagerExtension._find_dropper",
                 "scheduler/amm.py", "replaced on the instance to spare replicas under a stream",
                 ("ts", "candidates", "pending_drop"), exact=True),
    ),
    # ---- array/bag reductions: the rewrite, the worker's takeover, and dask's task spec and aggregates it recognises
    *_feature(GRAPH_REDUCTIONS,
        Internal(f"{_W}.handle_stimulus", "graph_reductions/worker_takeover.py", "replaced on the instance to rewrite aggregate tasks",
                 ("stims",), exact=True),
        Internal(f"{_WSM}.ComputeTaskEvent", "graph_reductions/worker_takeover.py", "rewritten for aggregate tasks",
                 fields=("key", "who_has", "nbytes", "run_spec")),
        Internal(f"{_S}._create_taskstate_from_graph", "graph_reductions/scheduler_hook.py",
                 "replaced on the instance to rewrite array/bag aggregates", ("dsk", "keys", "ordered")),
        Internal("dask._task_spec.Task.fuse", "graph_reductions/rewrite.py", "re-fuses a chain around an aggregate"),
        Internal("dask._task_spec._execute_subgraph", "graph_reductions/rewrite.py", "marks a fused task"),
        Internal("dask._task_spec._identity_cast", "graph_reductions/recognize.py", "list-building tasks"),
        Internal("dask.array.core._concatenate2", "graph_reductions/recognize.py", "array aggregates"),
        Internal("dask.array.reductions.mean_agg", "graph_reductions/recognize.py", "mean aggregates"),
        Internal("dask.array.reductions.mean_combine", "graph_reductions/recognize.py", "mean aggregates"),
        Internal("dask.array.reductions.chunk_max", "graph_reductions/recognize.py", "max aggregates"),
        Internal("dask.array.reductions.chunk_min", "graph_reductions/recognize.py", "min aggregates"),
        Internal("dask.array.routines._chunk_sum", "graph_reductions/recognize.py", "x @ y, tensordot"),
        Internal("dask.bag.core._reduce", "graph_reductions/recognize.py", "bag folds"),
        Internal("dask.bag.core.empty_safe_aggregate", "graph_reductions/recognize.py", "bag aggregates"),
    ),
    # ---- prompt stealing: Dask's work stealing, asked sooner for tasks needing a large key
    *_feature(PROMPT_STEALING,
        Internal(f"{_S}.idle", "scheduler/prompt_stealing.py", "the idle workers, thieves"),
        Internal(f"{_S}._get_prefix_duration", "scheduler/prompt_stealing.py",
                 "a task's expected compute time, as Dask's stealing has it", ("prefix",)),
        Internal(f"{_S}.get_comm_cost", "scheduler/prompt_stealing.py",
                 "a task's transfer time to a worker", ("ts", "ws")),
        Internal("distributed.scheduler.TaskState.prefix", "scheduler/prompt_stealing.py",
                 "the task's prefix, for its duration"),
        Internal("distributed.scheduler.WorkerState.processing", "scheduler/prompt_stealing.py",
                 "the tasks a worker runs or has queued"),
        Internal("distributed.scheduler.WorkerState.occupancy", "scheduler/prompt_stealing.py",
                 "a worker's expected busy time"),
        Internal(f"{_ST}.move_task_request", "scheduler/prompt_stealing.py",
                 "asks the victim to give a task up", ("ts", "victim", "thief")),
        Internal(f"{_ST}.in_flight", "scheduler/prompt_stealing.py", "steals asked, not confirmed"),
        Internal(f"{_ST}.in_flight_tasks", "scheduler/prompt_stealing.py",
                 "tasks moving to or from a worker"),
        Internal(f"{_ST}.in_flight_occupancy", "scheduler/prompt_stealing.py",
                 "occupancy moving to or from a worker"),
    ),
    # ---- hoplite's transfers in Dask's bookkeeping
    *_feature(ACCOUNTING,
        Internal(f"{_W}._get_cause", "worker/accounting.py", "the task a transfer's startstops go to", ("keys",)),
        Internal(f"{_W}._update_metrics_received_data", "worker/accounting.py",
                 "records a hoplite fetch as Dask records its own", ("start", "stop", "data", "cause", "worker")),
        Internal(f"{_W}.transfer_incoming_log", "worker/accounting.py", "hoplite's fetches of untracked keys"),
        Internal(f"{_W}.transfer_outgoing_log", "worker/accounting.py", "hoplite's streams out"),
        Internal(f"{_W}.transfer_outgoing_count", "worker/accounting.py", "open streams out"),
        Internal(f"{_W}.transfer_outgoing_count_total", "worker/accounting.py", "streams out, ever"),
        Internal(f"{_W}.transfer_outgoing_bytes", "worker/accounting.py", "bytes of open streams out"),
        Internal(f"{_W}.transfer_outgoing_bytes_total", "worker/accounting.py", "bytes streamed out, ever"),
        Internal(f"{_W}.bandwidth_workers", "worker/accounting.py", "bandwidth per peer"),
        Internal(f"{_W}.scheduler_delay", "worker/accounting.py", "clock offset of logged times"),
        Internal(f"{_W}.digest_metric", "worker/accounting.py", "transfer digests, fine metrics", ("name", "value")),
    ),
    # ---- the dashboard and metrics
    *_feature(DASHBOARD,
        Internal("distributed.node.ServerNode._setup_logging", "worker/plugin.py",
                 "sets the worker's _deque_handler: hoplite's records in get_worker_logs", ("logger",)),
        Internal(f"{_W}.metrics", "worker/plugin.py", "stream progress in the heartbeat"),
    ),
)  # fmt: skip


class _Gone:
    """Stands in for a private name a release no longer has: importing the
    module that names it still works (the feature needing it is turned off by
    :func:`find_drifts`); using it raises, naming it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedDistributed(f"{self.path} is gone from this release of distributed/dask")

    def __repr__(self) -> str:
        return f"<gone: {self.path}>"


def private(module: str, name: str) -> Any:
    """``module.name``, a private name dask-hoplite imports at module level,
    or a stand-in if this release lacks it: a drift turns off one feature
    (:func:`find_drifts`), never the import of dask-hoplite."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return _Gone(f"{module}.{name}")


def installed_distributed_version() -> str:
    return distributed.__version__


def check_distributed_version(version: str | None = None) -> str | None:
    """Raise :class:`UnsupportedDistributed` if ``version`` (default: the
    installed one) is older than :data:`TESTED_RANGE`; a warning to log if it
    is newer (untested: each feature still checks its internals); else None."""
    version = version or installed_distributed_version()
    low, high = TESTED_RANGE
    try:
        v = Version(version)
    except Exception as e:
        raise UnsupportedDistributed(f"cannot parse distributed version {version!r}") from e
    if v < low:
        raise UnsupportedDistributed(
            f"dask-hoplite needs distributed >= {low}; this process runs distributed "
            f"{version}. Upgrade it (pip install 'distributed>={low}') or use Dask without "
            "the plugin."
        )
    if Version(v.base_version) > high:
        return (
            f"dask-hoplite was tested with distributed {low} to {high}; this process runs "
            f"distributed {version}, untested. Each feature checks the internals it needs "
            "and turns itself off if one changed."
        )
    return None


class _NeedsInstance(Exception):
    """The attribute exists on instances only, and none was given."""


def _resolve(path: str, instances: Mapping[type, Any]) -> Any:
    """The object at ``path``: the longest importable module prefix, then
    attributes; one that only instances of a class have is taken from the
    live instance of that class in ``instances``."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        break
    else:
        raise AttributeError(f"no module in {path!r} can be imported")
    for name in parts[i:]:
        if isinstance(obj, type) and not hasattr(obj, name):
            # An instance attribute. (A class attribute is read on the class:
            # on a live instance it may be hoplite's own override.)
            live = next((v for t, v in instances.items() if issubclass(t, obj)), None)
            if live is None:
                if _set_on_instances(obj, name):
                    raise _NeedsInstance(obj.__qualname__)
                raise AttributeError(f"{obj.__qualname__} has no attribute {name!r}")
            obj = getattr(live, name)
        else:
            obj = getattr(obj, name)
    return obj


def _set_on_instances(cls: type, name: str) -> bool:
    """Whether ``cls`` or a base declares ``name`` for its instances: an
    annotation, or an assignment ``self.name = ...`` in its ``__init__``."""
    for c in cls.__mro__:
        if name in getattr(c, "__annotations__", {}):
            return True
        init = c.__dict__.get("__init__")
        try:
            if init is not None and f"self.{name} =" in inspect.getsource(init):
                return True
        except (OSError, TypeError):
            continue
    return False


def _problem(internal: Internal, instances: Mapping[type, Any], complete: bool) -> str | None:
    try:
        obj = _resolve(internal.path, instances)
    except _NeedsInstance as e:
        return None if not complete else f"it needs a live {e} to be checked"
    except AttributeError as e:
        return f"it is gone ({e})"
    if internal.params is not None:
        try:
            params = [p for p in inspect.signature(obj).parameters if p != "self"]
        except (TypeError, ValueError) as e:
            return f"its signature cannot be read ({e})"
        wanted = list(internal.params)
        if internal.exact and params != wanted:
            return f"its parameters are {params}, dask-hoplite overrides it with {wanted}"
        if not internal.exact and not set(wanted) <= set(params):
            return f"its parameters are {params}, dask-hoplite passes {wanted}"
    if internal.fields is not None:
        have = {f.name for f in dataclasses.fields(obj)}
        if not set(internal.fields) <= have:
            return f"its fields are {sorted(have)}, dask-hoplite uses {list(internal.fields)}"
    return None


def find_drifts(
    instances: Iterable[Any] = (),
    side: str | None = None,
    internals: Iterable[Internal] = PRIVATE_INTERNALS,
) -> list[Drift]:
    """The internals of ``internals`` (those checked on ``side``, "worker" or
    "scheduler"; None: all) that are gone or changed, each with its feature.
    Attributes that only instances have are checked on the live objects in
    ``instances`` (a Worker, a Scheduler), skipped without one."""
    live = {type(x): x for x in instances}
    return [
        Drift(i.feature, i.path, p)
        for i in internals
        if (side is None or i.side == side) and (p := _checked(i, live)) is not None
    ]


def _checked(internal: Internal, live: Mapping[type, Any]) -> str | None:
    """:func:`_problem`, with any error of the check itself reported as a
    problem (a class that stopped being a dataclass, say): a check never
    stops the plugin from starting."""
    try:
        return _problem(internal, live, False)
    except Exception as e:
        return f"it cannot be checked ({type(e).__name__}: {e})"


def check_internals(
    instances: Iterable[Any] = (),
    internals: Iterable[Internal] = PRIVATE_INTERNALS,
    *,
    complete: bool = False,
) -> None:
    """Raise :class:`UnsupportedDistributed` naming every internal of
    ``internals`` that is gone or changed, and the feature it turns off.

    Attributes that only instances have (declared on the class, set in
    ``__init__``) are checked on the live objects in ``instances`` (a Worker,
    a Scheduler, a comm); without one they are skipped, or, with
    ``complete``, reported."""
    live = {type(x): x for x in instances}
    problems = [
        f"{i.path} (used by dask_hoplite/{i.used_by}: {i.why}): {p}; the {i.feature} turns off"
        for i in internals
        if (p := _problem(i, live, complete)) is not None
    ]
    if problems:
        raise UnsupportedDistributed(
            f"dask-hoplite relies on private internals of distributed/dask that changed in "
            f"distributed {installed_distributed_version()}:\n  " + "\n  ".join(problems)
        )


def worker_addresses(client: Any) -> list[str]:
    """The addresses of the cluster's workers, sorted, asked of the scheduler.

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: in the tested
    releases that call refreshes the client's cached identity and returns the
    cache, which the client's periodic refresh (asking for no workers) can
    overwrite in between, so a live cluster sometimes looks empty."""
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
