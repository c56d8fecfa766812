"""The :class:`Hoplite` scheduler plugin: wiring only.

Dask starts and closes a ``SchedulerPlugin`` and calls its event hooks; this
module turns that lifecycle into installing and removing the scheduler part's
handlers and overrides, forwards Dask's events to the directory service, and
registers the worker part on every worker. What the handlers do lives in the
modules it imports (see :mod:`dask_hoplite.scheduler`), none of which knows
the plugin.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask.typing import Key
from distributed import SchedulerPlugin
from distributed.protocol.pickle import dumps

from dask_hoplite import logs
from dask_hoplite._version import __version__
from dask_hoplite.compat import (
    check_distributed_version,
    find_drifts,
    installed_distributed_version,
)
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.directory import ObjectDirectory
from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.measured_sizes import MEASURED_OP, MeasuredSizes
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.core.relay_rates import PROGRESS_OP
from dask_hoplite.dashboard.live import live_state
from dask_hoplite.dashboard.page import DashboardRoutes
from dask_hoplite.features import (
    AMM_GUARD,
    COLLECTIVES,
    DASHBOARD,
    GRAPH_REDUCTIONS,
    PROMPT_STEALING,
    REPLICATE,
    TRANSPORT,
    FeatureSet,
    announce,
)
from dask_hoplite.graph_reductions.scheduler_hook import GraphRewrite
from dask_hoplite.patching import Override
from dask_hoplite.scheduler.amm import NeededReplicas, StreamDropGuard
from dask_hoplite.scheduler.cancellation import CollectiveCancels
from dask_hoplite.scheduler.collective_log import CollectiveLog
from dask_hoplite.scheduler.directory_service import DirectoryService
from dask_hoplite.scheduler.first_ready import FirstReady
from dask_hoplite.scheduler.measured_sizes import MeasuredSizesService
from dask_hoplite.scheduler.metrics import SCHEDULER_SERIES, SchedulerSource
from dask_hoplite.scheduler.peers import Peers
from dask_hoplite.scheduler.prompt_stealing import PromptStealing
from dask_hoplite.scheduler.queries import SchedulerQueries
from dask_hoplite.scheduler.reduction_coordinator import ReductionCoordinator
from dask_hoplite.scheduler.replicate import ReplicateOverride
from dask_hoplite.scheduler.spares_used import SparesUsed
from dask_hoplite.scheduler_calls import METADATA_KEY, SCHEDULER_PART_KEY
from dask_hoplite.worker.context import PLUGIN_NAME
from dask_hoplite.worker.nanny_memory import HopliteNanny
from dask_hoplite.worker.plugin import HopliteWorker

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


def _send_to_worker(s: Scheduler, worker: str, msg: dict[str, Any]) -> None:
    """Send ``msg`` on the scheduler's stream to ``worker`` (if still there)."""
    stream = s.stream_comms.get(worker)
    if stream is not None:
        stream.send(msg)


def _worker_processes(s: Scheduler, host: str) -> int:
    """How many worker processes run on ``host``: workers in one process
    (``LocalCluster(processes=False)``, tests) share memory already and count
    once."""
    addresses = s.host_info.get(host, {}).get("addresses", ())
    return len({s.workers[a].pid for a in addresses if a in s.workers})


def _registry(s: Scheduler, name: str) -> dict[str, Any]:
    """Where handler ``name`` goes: an RPC is called as ``rpc.<name>(...)``, so
    its name is an identifier; a stream message's op is hyphenated."""
    return s.handlers if name.isidentifier() else s.stream_handlers


class Hoplite(SchedulerPlugin):
    """dask-hoplite: pipelined, directory-driven transfers of large keys.

    Register it once per cluster::

        client.register_plugin(dask_hoplite.Hoplite())

    or start the scheduler with ``--preload dask_hoplite``. Workers get their
    part from the scheduler, including workers that join later or restart.
    Registering again replaces the running instance and keeps its directory.
    Settings come from the ``hoplite`` section of ``dask.config`` on the
    scheduler and on each worker (see ``hoplite.yaml``).
    """

    name = "hoplite"

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.config: HopliteConfig | None = None
        self.directory: ObjectDirectory | None = None
        self.network: NetworkModel | None = None
        self.service: DirectoryService | None = None
        self.sizes: MeasuredSizesService | None = None
        self.replicator: ReplicateOverride | None = None
        self.first_ready: FirstReady | None = None
        self.reductions: ReductionCoordinator | None = None
        self.prompt_stealing: PromptStealing | None = None
        self.spares_used: SparesUsed | None = None
        self.cancels: CollectiveCancels | None = None
        self.collectives: CollectiveLog | None = None
        self.series: SchedulerSource | None = None
        #: The features running on the scheduler (see :mod:`dask_hoplite.features`).
        self.features: FeatureSet = FeatureSet.all_on()
        #: The features running on each worker.
        self.peers: Peers | None = None
        self.overrides: list[Override] = []
        #: The one handler table: RPC / stream-message name -> handler.
        self.handler_table: dict[str, Callable[..., Any]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    # ---------------------------------------------------------------- lifecycle

    async def start(self, scheduler: Scheduler) -> None:
        logs.show_warnings()
        untested = check_distributed_version()
        if untested:
            logger.warning(untested)
        where = f"the scheduler {scheduler.address}"
        # The extensions too: work stealing's attributes are checked on it.
        live = [scheduler, *scheduler.extensions.values()]
        self.features = FeatureSet.decide(find_drifts(live, side="scheduler"))
        announce(self.features, where, installed_distributed_version(), scheduler.log_event)
        if TRANSPORT not in self.features:
            return  # Dask's own transfers for everything; the warning said so
        config = self.config = HopliteConfig.from_dask_config()
        previous = scheduler.plugins.get(self.name)
        if isinstance(previous, Hoplite) and previous.scheduler is not None:
            # Registered again: unhook the old instance so no handler is
            # installed twice, then take over its running directory.
            previous._uninstall()
        else:
            previous = None
        self._build(scheduler, config, previous)
        self.scheduler = scheduler
        self._install(scheduler)
        await self._register_worker_part(scheduler)
        if config.host_sharing:
            await self._register_nanny_part(scheduler)
        logger.info("hoplite %s installed (fanout %d)", __version__, config.fanout)

    async def close(self) -> None:
        self._uninstall()

    def _build(self, s: Scheduler, config: HopliteConfig, previous: Hoplite | None) -> None:
        """The services, overrides and handler table; the directory, network
        model, parked requests, replicate pins, measured sizes, spares
        records and reduction run count of ``previous`` if given."""
        sizes = MeasuredSizes()
        if previous is not None:
            self.directory, self.network = previous.directory, previous.network
            self.collectives = previous.collectives
            self.spares_used = previous.spares_used
            if previous.sizes is not None:
                sizes = previous.sizes.sizes
        if self.collectives is None:
            self.collectives = CollectiveLog()
        if self.spares_used is None:
            self.spares_used = SparesUsed()
        if self.directory is None:  # (not `or`: an empty directory is falsy)
            self.directory = ObjectDirectory(fanout=config.fanout)
        if self.network is None:
            self.network = NetworkModel()
        directory, network = self.directory, self.network
        directory.fanout = config.fanout
        network.fixed_bandwidth = config.reduce_bandwidth
        network.fixed_latency = config.reduce_latency
        waiting = previous.service.waiting if previous and previous.service else None
        pins = previous.replicator.pins if previous and previous.replicator else None
        send = functools.partial(_send_to_worker, s)
        self.sizes = MeasuredSizesService(sizes, s.tasks.get, send)
        self.service = service = DirectoryService(
            directory,
            network,
            config,
            s.tasks.get,
            waiting,
            sizes,
            hosts=lambda: len(s.host_info),  # Dask keeps one entry per host with workers
            host_workers=lambda a: _worker_processes(s, host_of(a)),
            send=send,
            log_event=s.log_event,
        )
        self.series = SchedulerSource(lambda: s.address, service, self.collectives)
        queries = SchedulerQueries(s.tasks.get, network)
        self.first_ready = first_ready = FirstReady(s.tasks.get, network)
        self.reductions = reductions = ReductionCoordinator(
            first_ready,
            network,
            s.tasks.get,
            lambda: s.workers,
            s.set_restrictions,
            counter=previous.reductions.counter if previous and previous.reductions else None,
            latest=previous.reductions.latest if previous and previous.reductions else None,
        )
        spares_used = self.spares_used
        if COLLECTIVES in self.features:
            self.cancels = CollectiveCancels(send)
        self.replicator = ReplicateOverride(config, pins, sizes)
        collectives = self.collectives
        self.peers = peers = Peers(self.features, self._outsider, self._publish)
        on = self.features
        self.overrides = []
        if REPLICATE in on:
            self.overrides.append(self.replicator)
        if DASHBOARD in on:
            self.overrides.append(
                DashboardRoutes(lambda: live_state(s, service, collectives, network))
            )
        if GRAPH_REDUCTIONS in on and (config.array_reductions or config.bag_reductions):
            self.overrides.append(GraphRewrite(config))
        if AMM_GUARD in on and config.protect_streams:
            sources: list[Callable[[Key], set[str]]] = [
                directory.pinned,
                self.replicator.pinned,
            ]
            if config.keep_while_needed:
                sources.append(NeededReplicas(s.tasks.get, sizes, config.min_bytes))
            self.overrides.append(StreamDropGuard(*sources))
        self.prompt_stealing = None
        if PROMPT_STEALING in on and config.prompt_stealing:
            self.prompt_stealing = PromptStealing.on_scheduler(
                s, sizes, config.min_bytes, config.stealing_delay
            )
        self.handler_table = {
            "hoplite_request": service.request,
            "hoplite_info": service.info,
            "hoplite_plan_split": service.plan_split,
            "hoplite-finished": service.finished,
            "hoplite-released": service.released,
            PROGRESS_OP: service.progress,
            MEASURED_OP: self.sizes.measured,
            "hoplite-collective": self.collectives.finished,
            "hoplite_network": queries.network_estimate,
            "hoplite_key_states": queries.key_states,
            "hoplite_task_worker": queries.task_worker,
            "hoplite_first_ready": first_ready.first_ready,
            "hoplite_plan_reduction": reductions.plan_reduction,
            "hoplite_replan_tree": reductions.replan_tree,
            "hoplite_spares_used": spares_used.used,
            "hoplite_reduced_inputs": spares_used.reduced_inputs,
            "hoplite_worker_features": peers.reported,
            "hoplite_features": peers.to_msg,
        }

    def _install(self, s: Scheduler) -> None:
        for name, handler in self.handler_table.items():
            _registry(s, name)[name] = handler
        for override in self.overrides:
            override.install(s)
        s.set_metadata(keys=[SCHEDULER_PART_KEY], value=__version__)
        if self.series is not None and DASHBOARD in self.features:
            SCHEDULER_SERIES.add(self.series)
        if self.peers is not None:
            # Outsiders until their part reports its features.
            self.peers.joined(list(s.workers))

    def _outsider(self, address: str, outsider: bool) -> None:
        """Whether the directory may hand ``address`` out as a sender."""
        if self.directory is None:
            return
        if outsider:
            self.directory.outsiders.add(address)
        else:
            self.directory.outsiders.discard(address)

    def _publish(self) -> None:
        """Clients and planning tasks ask the scheduler's metadata (a standard
        RPC) whether the collectives run here: the version while the
        scheduler and every worker run them, None otherwise (Dask's way)."""
        s = self.scheduler
        if s is None or self.peers is None:
            return
        value = __version__ if self.peers.everywhere(COLLECTIVES) else None
        s.set_metadata(keys=[METADATA_KEY], value=value)

    def _uninstall(self) -> None:
        s, self.scheduler = self.scheduler, None
        if s is None:
            return
        if self.series is not None and DASHBOARD in self.features:
            SCHEDULER_SERIES.remove(self.series)
        for name, handler in self.handler_table.items():
            registry = _registry(s, name)
            if registry.get(name) is handler:
                del registry[name]
        for override in reversed(self.overrides):
            override.restore()
        self.prompt_stealing = None
        s.set_metadata(keys=[METADATA_KEY], value=None)
        s.set_metadata(keys=[SCHEDULER_PART_KEY], value=None)

    async def _register_worker_part(self, scheduler: Scheduler) -> None:
        responses = await scheduler.register_worker_plugin(
            None,
            dumps(HopliteWorker(__version__, sorted(self.features.on))),
            name=PLUGIN_NAME,
            idempotent=False,
        )
        failed = {a: r for a, r in responses.items() if r.get("status") != "OK"}
        if failed:
            # Those workers keep Dask's own transfers (outsiders); the rest
            # of the cluster runs hoplite.
            logger.warning(
                "dask-hoplite's worker part did not start on %s; they keep Dask's own transfers",
                ", ".join(f"{a}: {r.get('exception_text') or r}" for a, r in failed.items()),
            )
        self._publish()

    async def _register_nanny_part(self, scheduler: Scheduler) -> None:
        """The nannies' terminate threshold reads shared pages at their share
        (:mod:`dask_hoplite.worker.nanny_memory`); a nanny that fails to take
        it keeps Dask's reading."""
        try:
            responses = await scheduler.register_nanny_plugin(
                None, dumps(HopliteNanny()), name=HopliteNanny.name, idempotent=False
            )
        except Exception as e:
            logger.warning("could not register dask-hoplite's nanny part: %s", e)
            return
        failed = {a: r for a, r in responses.items() if r.get("status") != "OK"}
        if failed:
            logger.warning(
                "dask-hoplite's nanny part did not start on %s; their nannies read RSS",
                ", ".join(f"{a}: {r.get('exception_text') or r}" for a, r in failed.items()),
            )

    # -------------------------------------------------------- Dask's own events

    def transition(self, key: Key, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.service is not None:
            self.service.key_transitioned(key, start, finish, kwargs.get("worker"))
        if self.sizes is not None:
            self.sizes.key_transitioned(key, finish)
        if self.first_ready is not None:
            self.first_ready.key_transitioned(key, finish)
        if self.spares_used is not None:
            self.spares_used.key_transitioned(key, finish)
        if self.prompt_stealing is not None:
            self.prompt_stealing.key_transitioned(key, start, finish)
        if self.cancels is not None and self.scheduler is not None:
            ts = self.scheduler.tasks.get(key) if finish == "processing" else None
            where = ts.processing_on.address if ts is not None and ts.processing_on else None
            self.cancels.key_transitioned(key, finish, where)

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        if self.peers is not None and self.scheduler is not None:
            self.peers.joined([worker])

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        if self.service is not None:
            self.service.worker_removed(worker)
        if self.sizes is not None:
            self.sizes.worker_removed(worker)
        if self.cancels is not None:
            self.cancels.worker_removed(worker)
        if self.peers is not None and self.scheduler is not None:
            self.peers.left(worker)
