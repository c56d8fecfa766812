"""The worker part's plugin: lifecycle, one handler table, routing.

Installed by the scheduler part on every worker (also on workers that join
later or restart). ``setup`` checks versions, builds the shared
:class:`~dask_hoplite.worker.context.WorkerContext` and one object per job
(receiver, sender, partial copies, reduce nodes and roots, allreduce, the
aggregate takeover), installs Dask overrides and the peer handlers from one
table; ``teardown`` undoes all of it. Every handler hands its message to the
component that owns it; the plugin holds no logic of its own.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from dask.typing import Key
from distributed import WorkerPlugin, system
from distributed.worker import Worker
from tornado.ioloop import PeriodicCallback

from dask_hoplite import logs
from dask_hoplite._version import __version__
from dask_hoplite.compat import (
    check_distributed_version,
    find_drifts,
    installed_distributed_version,
)
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.buffer_pool import auto_reserve
from dask_hoplite.core.measured_sizes import SIZES_OP
from dask_hoplite.core.protocol import STREAM_OP
from dask_hoplite.core.relay_rates import REROUTE_OP
from dask_hoplite.core.store import BlockStore, BufferPool
from dask_hoplite.errors import NotRegistered, VersionMismatch
from dask_hoplite.features import (
    COLLECTIVES,
    DASHBOARD,
    FETCH,
    GRAPH_REDUCTIONS,
    REPLICATE,
    TRANSPORT,
    FeatureSet,
    announce,
)
from dask_hoplite.graph_reductions.worker_takeover import AggregateTakeover
from dask_hoplite.patching import AttributePatch, ItemPatch
from dask_hoplite.worker import memfd_regions
from dask_hoplite.worker.allreduce import Allreduce
from dask_hoplite.worker.context import PLUGIN_NAME, WorkerContext
from dask_hoplite.worker.fetch_paths import DaskFetchPaths
from dask_hoplite.worker.host_sharing import HostSharing
from dask_hoplite.worker.measuring import SizeMeasuring
from dask_hoplite.worker.metrics import WORKER_SERIES
from dask_hoplite.worker.partial_copies import PartialCopies
from dask_hoplite.worker.prefault import Prefaulter
from dask_hoplite.worker.progress import METRIC, ProgressReport
from dask_hoplite.worker.receiver import Receiver
from dask_hoplite.worker.reduce_node import ReduceNodes
from dask_hoplite.worker.reduce_root import ReduceRoots
from dask_hoplite.worker.reductions import RunningReductions
from dask_hoplite.worker.running_tasks import CANCEL_OP, RunningTasks
from dask_hoplite.worker.sender import Sender
from dask_hoplite.worker.shared_pages import shared_aware
from dask_hoplite.worker.small_allreduce import SmallAllreduce
from dask_hoplite.worker.timelines import Timelines

logger = logging.getLogger(__name__)

#: Seconds a worker's setup waits at most for its reserve of receive memory
#: to be faulted in (about 0.3 s per 256 MiB on a slow virtual machine).
RESERVE_WAIT = 10.0

_TRIM_CALLBACK = "hoplite-pool-trim"


@dataclasses.dataclass
class WorkerParts:
    """The components of a running worker part, built together by ``setup``."""

    ctx: WorkerContext
    receiver: Receiver
    fetch_paths: DaskFetchPaths
    partial_copies: PartialCopies
    measuring: SizeMeasuring
    sender: Sender
    reductions: RunningReductions
    nodes: ReduceNodes
    roots: ReduceRoots
    allreduce: Allreduce
    small_allreduce: SmallAllreduce
    aggregates: AggregateTakeover
    prefaulter: Prefaulter | None
    running_tasks: RunningTasks = dataclasses.field(default_factory=RunningTasks)

    @classmethod
    def build(
        cls, worker: Worker, config: HopliteConfig, features: FeatureSet | None = None
    ) -> WorkerParts:
        prefaulter = Prefaulter() if config.prefault else None
        pool = BufferPool(
            config.buffer_pool_bytes,
            prefaulter.submit if prefaulter else None,
            spare=config.buffer_pool_spare,
        )
        reserve = config.buffer_pool_reserve
        if reserve is None:  # "auto": a fraction of the worker's memory limit
            manager = getattr(worker, "memory_manager", None)
            reserve = auto_reserve(getattr(manager, "memory_limit", None), system.MEMORY_LIMIT)
        pool.reserve(reserve, config.buffer_pool_reserve_regions)
        ctx = WorkerContext(worker, BlockStore(pool), config)
        if features is not None:
            ctx.features = features.on
        if config.timelines:
            ctx.timelines = Timelines(interval=config.timeline_interval)
        receiver = Receiver(ctx)
        reductions = RunningReductions(ctx)
        sender = Sender(ctx, hooks=reductions)
        if config.host_sharing and memfd_regions.available():
            ctx.sharing = HostSharing(
                ctx.store,
                worker.address,
                prefaulter.submit if prefaulter else None,
                source=sender.source,
            )
        nodes = ReduceNodes(ctx, reductions)
        roots = ReduceRoots(ctx, reductions, nodes)
        return cls(
            ctx=ctx,
            receiver=receiver,
            fetch_paths=DaskFetchPaths(ctx, receiver, worker.gather_dep, worker.handlers["gather"]),
            partial_copies=PartialCopies(ctx, receiver.is_fetching),
            measuring=SizeMeasuring(ctx),
            sender=sender,
            reductions=reductions,
            nodes=nodes,
            roots=roots,
            prefaulter=prefaulter,
            allreduce=Allreduce(ctx, reductions, roots, receiver.fetch_parts),
            small_allreduce=SmallAllreduce(ctx, receiver.fetch_parts),
            aggregates=AggregateTakeover(ctx, roots, receiver.fetch_parts),
        )


def _kept_for_subclasses(worker: Worker) -> dict[str, str]:
    """The features this worker keeps Dask's way because its class overrides
    what they replace or bypass. A ``Worker`` subclass's own ``gather_dep`` is
    called as the subclass means it (hoplite replaces it on the instance,
    which would hide the override): such a worker fetches Dask's way. One
    that overrides ``get_data`` serves its data its own way, which hoplite's
    streams would bypass: it is no hoplite peer at all (transport off)."""
    cls = type(worker)
    kept: dict[str, str] = {}
    if cls.get_data is not Worker.get_data:
        kept[TRANSPORT] = f"{cls.__qualname__} overrides get_data; its data goes out its way"
    if cls.gather_dep is not Worker.gather_dep:
        kept[FETCH] = (
            f"{cls.__qualname__} overrides gather_dep; its override runs, Dask's fetch with it"
        )
    for why in kept.values():
        logger.info("worker %s: %s", worker.address, why)
    return kept


class HopliteWorker(WorkerPlugin):
    """Worker half of dask-hoplite. Users do not create this themselves: the
    scheduler plugin :class:`dask_hoplite.Hoplite` registers it.

    Parameters
    ----------
    scheduler_version:
        The dask-hoplite version of the scheduler that sent this plugin; a
        worker with another version refuses to start the plugin.
    scheduler_features:
        The features running on the scheduler (None: all); a worker runs
        those of them whose internals hold on it.
    """

    name = PLUGIN_NAME

    def __init__(
        self, scheduler_version: str = __version__, scheduler_features: list[str] | None = None
    ) -> None:
        self.scheduler_version = scheduler_version
        self.scheduler_features = scheduler_features
        #: The features running on this worker.
        self.features = FeatureSet.decide([], allowed=scheduler_features)
        self._parts: WorkerParts | None = None
        self._patches: list[AttributePatch | ItemPatch] = []

    def __getstate__(self) -> dict[str, Any]:
        return {
            "scheduler_version": self.scheduler_version,
            "scheduler_features": self.scheduler_features,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["scheduler_version"], state.get("scheduler_features")
        )

    # ------------------------------------------------------------ lifecycle

    async def setup(self, worker: Worker) -> None:
        if self.scheduler_version != __version__:
            raise VersionMismatch(
                f"dask-hoplite {__version__} on worker {worker.address} does not match "
                f"dask-hoplite {self.scheduler_version} on the scheduler; install the same "
                "version everywhere. This worker keeps using Dask's own transfers."
            )
        check_distributed_version()
        features = self.features = FeatureSet.decide(
            find_drifts([worker], side="worker"),
            allowed=self.scheduler_features,
            disabled=_kept_for_subclasses(worker),
        )
        announce(
            features, f"worker {worker.address}", installed_distributed_version(), worker.log_event
        )
        if TRANSPORT in features:
            self._install(worker, features)
        try:
            await worker.scheduler.hoplite_worker_features(
                address=worker.address,
                on=sorted(features.on),
                off={o.feature: o.reason for o in features.off},
            )
        except Exception as e:  # an older scheduler part: it finds out by itself
            logger.warning("could not tell the scheduler the features of %s: %s", worker.address, e)
        parts = self._parts
        if parts is not None and parts.ctx.sharing is not None:
            try:
                await parts.ctx.sharing.start()
            except OSError as e:
                logger.warning(
                    "%s: no region server (%s); this worker keeps copies of its own",
                    worker.address,
                    e,
                )
                parts.ctx.sharing = None
        # The worker takes no task before its setup returns, and
        # client.register_plugin returns once every worker's has: the
        # reserve of receive memory (hoplite.buffer-pool-reserve) is faulted
        # in before the first transfer can want it, not under it.
        if (
            parts is not None
            and parts.prefaulter is not None
            and not await parts.prefaulter.settled(RESERVE_WAIT)
        ):
            logger.info(
                "%s: receive memory still being faulted in after %.0f s; going on",
                worker.address,
                RESERVE_WAIT,
            )

    def _install(self, worker: Worker, features: FeatureSet) -> None:
        """Build the components and install the overrides of the features on."""
        parts = self._parts = WorkerParts.build(worker, HopliteConfig.from_dask_config(), features)
        # Each override of a Dask internal is one patch, undone on its own.
        self._patches = [*(ItemPatch(worker.handlers, n, h) for n, h in self._handlers().items())]
        if COLLECTIVES in features:
            self._patches.append(
                ItemPatch(worker.stream_handlers, CANCEL_OP, parts.running_tasks.cancel)
            )
        if FETCH in features:
            self._patches.append(AttributePatch(worker, "gather_dep", parts.fetch_paths.gather_dep))
            self._patches.append(
                ItemPatch(worker.stream_handlers, SIZES_OP, parts.measuring.learned)
            )
            self._patches.append(
                ItemPatch(worker.stream_handlers, REROUTE_OP, parts.receiver.reroute)
            )
        if REPLICATE in features:
            self._patches.append(ItemPatch(worker.handlers, "gather", parts.fetch_paths.gather))
        monitor = getattr(worker, "monitor", None)
        if parts.ctx.sharing is not None and monitor is not None:
            # Pages shared with the host's other workers count at their
            # share, not once per mapping, when Dask decides to spill or pause.
            self._patches.append(
                AttributePatch(
                    monitor, "get_process_memory", shared_aware(monitor.get_process_memory)
                )
            )
        if GRAPH_REDUCTIONS in features:
            self._patches.append(parts.aggregates.install(worker))
        interval = 1000 * min(1.0, parts.ctx.config.buffer_pool_idle)
        trim = PeriodicCallback(self._trim_pool, interval)
        worker.periodic_callbacks[_TRIM_CALLBACK] = trim
        trim.start()
        if DASHBOARD in features:
            WORKER_SERIES.add(parts.ctx)
            worker.metrics[METRIC] = ProgressReport(parts.ctx)
            logs.to_worker_log(getattr(worker, "_deque_handler", None))
        logs.show_warnings()
        logger.debug("hoplite worker part installed on %s", worker.address)

    def _handlers(self) -> dict[str, Callable[..., Any]]:
        """Every peer RPC of the worker part, by name."""
        p = self.parts
        return {
            STREAM_OP: p.sender.handle_stream,
            "hoplite_worker_info": self.info,
            "hoplite_reduce_node": p.nodes.handle_node,
            "hoplite_reduce_abort": p.reductions.abort,
            "hoplite_reduce_running": p.reductions.running,
            "hoplite_reduce_release": p.reductions.release,
            "hoplite_reduce_replace": self._reduce_replace,
            "hoplite_reduce_adopt": p.nodes.handle_adopt,
            "hoplite_reduce_merge": p.nodes.handle_merge,
            "hoplite_result": p.small_allreduce.handle_result,
        }

    def teardown(self, worker: Worker) -> None:
        p = self._parts
        if p is None:
            return
        p.ctx.closed = True
        if p.ctx.sharing is not None:
            p.ctx.sharing.close()
        if p.prefaulter is not None:
            p.prefaulter.close()
        if DASHBOARD in self.features:
            WORKER_SERIES.remove(p.ctx)
            logs.off_worker_log(getattr(worker, "_deque_handler", None))
        if isinstance(worker.metrics.get(METRIC), ProgressReport):
            del worker.metrics[METRIC]
        p.fetch_paths.close()
        for patch in reversed(self._patches):
            patch.undo()
        self._patches = []
        p.running_tasks.close()
        p.reductions.close()
        p.partial_copies.close()
        trim = worker.periodic_callbacks.pop(_TRIM_CALLBACK, None)
        if trim is not None:
            trim.stop()
        for key in list(p.ctx.store.buffers):
            p.ctx.store.release(key)
        p.ctx.store.pool.clear()
        self._parts = None

    def transition(self, key: Key, start: str, finish: str, **kwargs: Any) -> None:
        """Dask moved ``key`` on this worker: wake the small-allreduce requests
        for it, keep, complete or drop our copy of it, and measure it if
        Dask cannot size it."""
        p = self._parts
        if p is None:
            return
        p.small_allreduce.task_finished(key, finish)
        p.partial_copies.transition(key, finish)
        p.measuring.transition(key, start, finish)

    # ------------------------------------------------------------ routing

    async def _reduce_replace(self, rid: str, slot: int, offset: int, dead: str) -> dict[str, Any]:
        """RPC ``hoplite_reduce_replace``, to the root of reduction ``rid``."""
        root = self.parts.reductions.roots.get(rid)
        if root is None:
            return {"status": "error", "message": f"reduction {rid} is not running here"}
        return await root.replace(slot, offset, dead)

    def _trim_pool(self) -> None:
        ctx = self.parts.ctx
        freed = ctx.store.pool.trim(ctx.config.buffer_pool_idle)
        if freed:
            logger.debug("returned %d idle pooled bytes to the OS", freed)

    def info(self) -> dict[str, Any]:
        """Handler ``hoplite_worker_info``: the store's size and counters."""
        ctx = self.parts.ctx
        return {
            "buffers": len(ctx.store),
            "nbytes": ctx.store.nbytes,
            "pool_idle_bytes": ctx.store.pool.idle_bytes,
            "pool_reused": ctx.store.pool.reused,
            "stats": dict(ctx.stats),
            "recent": list(ctx.recent),
            "version": __version__,
            "features": self.features.to_msg(),
        }

    # ------------------------------------------------- state, for info and tests

    @property
    def running(self) -> bool:
        return self._parts is not None

    @property
    def parts(self) -> WorkerParts:
        """The components (``plugin.parts.receiver``, ``.allreduce``...)."""
        if self._parts is None:
            raise NotRegistered("dask-hoplite's worker part is not set up on this worker")
        return self._parts

    @property
    def gather_dep(self) -> Callable[..., Any]:
        """What this plugin installed as ``worker.gather_dep``."""
        return self.parts.fetch_paths.gather_dep

    @property
    def stats(self) -> dict[str, int]:
        return self.parts.ctx.stats

    @property
    def store(self) -> BlockStore:
        return self.parts.ctx.store

    @property
    def config(self) -> HopliteConfig:
        return self.parts.ctx.config

    @config.setter
    def config(self, value: HopliteConfig) -> None:
        """Replace the settings every component reads (tests shorten timeouts)."""
        self.parts.ctx.config = value
