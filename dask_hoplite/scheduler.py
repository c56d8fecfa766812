"""The scheduler part: the :class:`Hoplite` plugin, a thin shell around the
sans-IO :class:`~dask_hoplite.core.directory.ObjectDirectory`.

It adds the handlers workers use to ask for a sender and to report transfers,
feeds Dask's own events (a key released, a worker removed) into the directory,
keeps the Active Memory Manager away from replicas under an active stream, makes
``client.replicate`` / ``scatter(broadcast=True)`` of large keys one pipelined
step instead of generations, and registers the worker part on every worker.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from distributed import SchedulerPlugin
from distributed.protocol.pickle import dumps

from dask_hoplite._version import __version__
from dask_hoplite.compat import check_distributed_version
from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.directory import Assign, Decision, Missing, ObjectDirectory, Queued
from dask_hoplite.core.graph_reduce import rewrite_graph
from dask_hoplite.core.network_model import NetworkModel
from dask_hoplite.core.protocol import PROTOCOL_VERSION
from dask_hoplite.worker import PLUGIN_NAME as WORKER_PLUGIN_NAME
from dask_hoplite.worker import HopliteWorker

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

logger = logging.getLogger(__name__)

from dask.typing import Key  # noqa: E402

_HANDLERS = (
    "hoplite_request",
    "hoplite_info",
    "hoplite_network",
    "hoplite_key_states",
    "hoplite_locate",
    "hoplite_task_worker",
)
_STREAM_HANDLERS = ("hoplite-finished", "hoplite-released")


def _decision_msg(d: Decision, nbytes: int) -> dict[str, Any]:
    if isinstance(d, Assign):
        return {
            "status": "assign",
            "sender": d.sender,
            "transfer_id": d.transfer_id,
            "nbytes": nbytes,
        }
    return {"status": "missing"}


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
        self.directory: ObjectDirectory | None = None
        self._waiting: dict[tuple[Key, str], asyncio.Future[Decision]] = {}
        self._replicating: dict[Key, set[str]] = defaultdict(set)
        self._originals: dict[str, Any] = {}
        self.network: NetworkModel | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    # ------------------------------------------------------------ lifecycle

    async def start(self, scheduler: Scheduler) -> None:
        check_distributed_version()
        self.config = HopliteConfig.from_dask_config()
        previous = scheduler.plugins.get(self.name)
        if isinstance(previous, Hoplite) and previous is not self and previous.scheduler:
            # Registered again: take over the running directory, then unhook the
            # old instance so no handler is installed twice.
            self.directory = previous.directory
            self._waiting = previous._waiting
            self._replicating = previous._replicating
            self.network = previous.network
            previous._uninstall()
        if self.directory is None:
            self.directory = ObjectDirectory(fanout=self.config.fanout)
        self.directory.fanout = self.config.fanout
        if self.network is None:
            self.network = NetworkModel()
        self.network.fixed_bandwidth = self.config.reduce_bandwidth
        self.network.fixed_latency = self.config.reduce_latency
        self.scheduler = scheduler
        self._install(scheduler)
        responses = await scheduler.register_worker_plugin(
            None,
            dumps(HopliteWorker(__version__)),
            name=WORKER_PLUGIN_NAME,
            idempotent=False,
        )
        failed = {a: r for a, r in responses.items() if r.get("status") != "OK"}
        if failed:
            logger.error("hoplite worker part failed to start on %s", failed)
            raise RuntimeError(
                "dask-hoplite's worker part failed to start on "
                + ", ".join(f"{a}: {r.get('exception_text') or r}" for a, r in failed.items())
            )
        logger.info("hoplite %s installed (fanout %d)", __version__, self.config.fanout)

    async def close(self) -> None:
        self._uninstall()

    def _install(self, s: Scheduler) -> None:
        s.handlers["hoplite_request"] = self.handle_request
        s.handlers["hoplite_info"] = self.handle_info
        s.handlers["hoplite_network"] = self.handle_network
        s.handlers["hoplite_locate"] = self.handle_locate
        s.handlers["hoplite_key_states"] = self.handle_key_states
        s.handlers["hoplite_task_worker"] = self.handle_task_worker
        s.stream_handlers["hoplite-finished"] = self.handle_finished
        s.stream_handlers["hoplite-released"] = self.handle_released

        self._originals["replicate"] = s.handlers["replicate"]
        s.handlers["replicate"] = self.replicate
        s.replicate = self.replicate  # type: ignore[method-assign]  # scatter(broadcast=True)

        if self.config.array_reductions or self.config.bag_reductions:
            self._originals["_create_taskstate_from_graph"] = s._create_taskstate_from_graph
            s._create_taskstate_from_graph = self._create_taskstate_from_graph  # type: ignore[method-assign]

        amm = s.extensions.get("amm")
        if amm is not None and self.config.protect_streams:
            self._originals["amm"] = amm
            self._originals["_find_dropper"] = amm._find_dropper
            amm._find_dropper = self._find_dropper

    def _uninstall(self) -> None:
        s = self.scheduler
        if s is None:
            return
        for name in _HANDLERS:
            s.handlers.pop(name, None)
        for name in _STREAM_HANDLERS:
            s.stream_handlers.pop(name, None)
        if "replicate" in self._originals:
            s.handlers["replicate"] = self._originals.pop("replicate")
            s.__dict__.pop("replicate", None)
        if self._originals.pop("_create_taskstate_from_graph", None) is not None:
            s.__dict__.pop("_create_taskstate_from_graph", None)
        amm = self._originals.pop("amm", None)
        if amm is not None:
            amm._find_dropper = self._originals.pop("_find_dropper")
        self.scheduler = None

    # ------------------------------------------------- Dask's own events

    def transition(self, key: Key, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.directory is None:
            return
        if finish == "released":
            # Lost (its holders died: a recomputation follows, and the
            # partial copies keep streaming) or released by its clients (then
            # "forgotten" follows at once).
            if key in self.directory.objects:
                logger.debug("%r went %s -> released: no complete copy left", key, start)
            self._act(self.directory.lost(key))
        elif finish in ("forgotten", "erred"):
            self._act(self.directory.forget(key))
        elif finish == "memory" and isinstance(kwargs.get("worker"), str):
            self._act(self.directory.copy_added(key, kwargs["worker"]))

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        if self.directory is not None:
            self._act(self.directory.worker_removed(worker))

    def _create_taskstate_from_graph(self, **kwargs: Any) -> Any:
        """The scheduler's entry point for a submitted graph (after all
        optimisation, before any task state exists), with the aggregates of
        dask.array reductions and dask.bag folds rewritten into pipelined
        reductions (see :mod:`dask_hoplite.core.graph_reduce`)."""
        original = self._originals["_create_taskstate_from_graph"]
        try:
            dsk, n = rewrite_graph(
                kwargs["dsk"],
                kwargs["keys"],
                self.config.array_max_inputs,
                arrays=self.config.array_reductions,
                bags=self.config.bag_reductions,
            )
        except Exception:
            logger.exception("hoplite could not rewrite a graph; running it as submitted")
        else:
            if n:
                logger.debug("%d array/bag aggregates run as hoplite reductions", n)
                kwargs["dsk"] = dsk
                # A task taken out of a fused one is ordered with its dependent.
                ordered = kwargs.get("ordered")
                if ordered:
                    for k, t in dsk.items():
                        for d in getattr(t, "dependencies", ()):
                            if d not in ordered and k in ordered:
                                ordered[d] = ordered[k]
        return original(**kwargs)

    # ---------------------------------------------------- worker handlers

    async def handle_request(
        self,
        key: Key,
        receiver: str,
        protocol: int | None = None,
        exclude: list[str] | None = None,
    ) -> dict[str, Any]:
        """RPC ``hoplite_request``: a worker needs ``key`` (or needs another
        sender than those in ``exclude`` to resume from); whom to stream from."""
        assert self.scheduler is not None and self.directory is not None
        if protocol != PROTOCOL_VERSION:
            return {
                "status": "error",
                "message": f"protocol {protocol!r} != scheduler's {PROTOCOL_VERSION}",
            }
        ts = self.scheduler.tasks.get(key)
        if ts is None or ts.state != "memory":
            # Not in memory anywhere (lost, being recomputed, or released):
            # the receiver's holders are stale; Dask finds the new copy.
            return {"status": "missing", "gone": True}
        nbytes = ts.nbytes or 0
        if nbytes < self.config.min_bytes:
            return {"status": "small"}
        holders = [ws.address for ws in ts.who_has or ()]
        decision = self.directory.request(key, receiver, holders, exclude or ())
        if isinstance(decision, Queued):
            fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
            self._waiting[(key, receiver)] = fut
            try:
                decision = await asyncio.wait_for(fut, self.config.queue_timeout)
            except asyncio.TimeoutError:
                logger.info("request of %s for %r timed out in the queue", receiver, key)
                if self.directory is not None:
                    self.directory.cancel_request(key, receiver)
                return {"status": "missing", "gone": not self._in_memory(key)}
            finally:
                if self._waiting.get((key, receiver)) is fut:
                    del self._waiting[(key, receiver)]
        logger.debug("%s asks for %r (excluding %s): %s", receiver, key, exclude, decision)
        msg = _decision_msg(decision, nbytes)
        if isinstance(decision, Missing):
            msg["gone"] = not self._in_memory(key)
        ts = self.scheduler.tasks.get(key)
        msg["holders"] = [ws.address for ws in (ts.who_has or ())] if ts is not None else []
        return msg

    def _in_memory(self, key: Key) -> bool:
        assert self.scheduler is not None
        ts = self.scheduler.tasks.get(key)
        return ts is not None and ts.state == "memory"

    def handle_finished(
        self,
        transfer_id: int,
        ok: bool,
        worker: str | None = None,
        nbytes: int = 0,
        seconds: float = 0.0,
        latency: float = 0.0,
        **kwargs: Any,
    ) -> None:
        """Stream ``hoplite-finished``: a receiver's transfer ended (with its
        size and duration, and the receiver's latency, for the network model)."""
        if self.directory is not None:
            self._act(self.directory.transfer_finished(transfer_id, bool(ok)))
        if self.network is not None and ok:
            self.network.observe_transfer(int(nbytes), float(seconds))
            self.network.observe_latency(float(latency))

    def handle_key_states(self, keys: list[Key]) -> dict[Key, str | None]:
        """RPC ``hoplite_key_states``: the scheduler's state of each key (None:
        unknown), so a reduction waiting for a lost input can tell a
        recomputation under way from an input that is gone for good."""
        assert self.scheduler is not None
        out: dict[Key, str | None] = {}
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            out[key] = None if ts is None else ts.state
        return out

    def handle_task_worker(self, key: Key) -> dict[str, Any]:
        """RPC ``hoplite_task_worker``: the scheduler's state of task ``key``
        and the worker that runs it or holds its result (None: no worker yet,
        or none any more), so a waiter can follow a task Dask moved."""
        assert self.scheduler is not None
        ts = self.scheduler.tasks.get(key)
        if ts is None:
            return {"state": None, "worker": None}
        ws = ts.processing_on or next(iter(ts.who_has or ()), None)
        return {"state": ts.state, "worker": None if ws is None else ws.address}

    def handle_network(self) -> dict[str, Any]:
        """RPC ``hoplite_network``: the bandwidth and latency reduce trees are
        planned with (see :mod:`dask_hoplite.core.network_model`)."""
        assert self.network is not None
        return self.network.estimate().to_msg()

    def handle_locate(self, keys: list[Key]) -> dict[str, Any]:
        """RPC ``hoplite_locate``: where each key is in memory, its size, and the
        network estimate: all a client plans a reduction with, in one round
        trip (what ``who_has``, ``nbytes`` and ``hoplite_network`` answer)."""
        assert self.scheduler is not None
        who_has: dict[Key, list[str]] = {}
        nbytes: dict[Key, int] = {}
        for key in keys:
            ts = self.scheduler.tasks.get(key)
            who_has[key] = [] if ts is None else [ws.address for ws in ts.who_has or ()]
            nbytes[key] = 0 if ts is None else max(ts.nbytes, 0)
        return {"who_has": who_has, "nbytes": nbytes, "network": self.handle_network()}

    def handle_released(self, key: Key, worker: str | None = None, **kwargs: Any) -> None:
        """Stream ``hoplite-released``: ``worker`` dropped its buffer of ``key``."""
        if self.directory is not None and worker is not None:
            self._act(self.directory.copy_released(key, worker))

    def handle_info(self) -> dict[str, Any]:
        """RPC ``hoplite_info``: the directory's state, for tests and dashboards."""
        d = self.directory
        assert d is not None
        return {
            "version": __version__,
            "fanout": d.fanout,
            "objects": len(d),
            "transfers": len(d.transfers),
            "waiting": len(self._waiting),
            "keys": [
                {
                    "key": rec.key,
                    "complete": sorted(rec.complete),
                    "partial": sorted(rec.incoming),
                    "peak_uploads": rec.peak_uploads,
                    "edges": [list(e) for e in rec.edges],
                }
                for rec in d.objects.values()
            ],
        }

    def _act(self, decisions: Iterable[Decision]) -> None:
        for d in decisions:
            fut = self._waiting.get((d.key, d.receiver))
            if fut is not None and not fut.done():
                fut.set_result(d)
            elif isinstance(d, Assign) and self.directory is not None:
                # Nobody waits any more: give the slot back.
                self._act(self.directory.transfer_finished(d.transfer_id, False))
            elif not isinstance(d, Missing):
                logger.debug("unclaimed directory decision %s", d)

    # -------------------------------------------------------- AMM cooperation

    def _pinned(self, ts: TaskState) -> set[WorkerState]:
        assert self.scheduler is not None and self.directory is not None
        addrs = self.directory.pinned(ts.key) | self._replicating.get(ts.key, set())
        workers = self.scheduler.workers
        return {workers[a] for a in addrs if a in workers}

    def _find_dropper(
        self,
        ts: TaskState,
        candidates: set[WorkerState] | None,
        pending_drop: set[WorkerState],
    ) -> WorkerState | None:
        """The AMM's ``_find_dropper``, minus workers under an active stream."""
        pinned = self._pinned(ts)
        if pinned:
            candidates = (set(ts.who_has or ()) if candidates is None else candidates) - pinned
            if not candidates:
                return None
        return self._originals["_find_dropper"](ts, candidates, pending_drop)

    # ------------------------------------------------------------ replicate

    async def replicate(
        self,
        keys: list[Key],
        n: int | None = None,
        workers: Iterable[str] | None = None,
        branching_factor: int = 2,
        delete: bool = True,
        stimulus_id: str | None = None,
    ) -> dict[str, Any] | None:
        """``Scheduler.replicate`` with large keys copied in one pipelined step.

        Dask copies in generations (each holder feeds ``branching_factor`` new
        ones, whole objects, then the next generation starts). With hoplite all
        missing replicas are requested at once and the directory chains them.
        Small keys keep Dask's own algorithm.
        """
        s = self.scheduler
        assert s is not None
        orig = self._originals["replicate"]
        large = [
            k for k in keys if k in s.tasks and (s.tasks[k].nbytes or 0) >= self.config.min_bytes
        ]
        small = [k for k in keys if k not in set(large)]
        result = None
        if small:
            result = await orig(
                keys=small,
                n=n,
                workers=workers,
                branching_factor=branching_factor,
                delete=delete,
                stimulus_id=stimulus_id,
            )
        if large:
            failed = await self._replicate_large(large, n, workers, delete, stimulus_id)
            if failed:
                prev = result["keys"] if result else []
                result = {"status": "partial-fail", "keys": list(prev) + failed}
        return result

    async def _replicate_large(
        self,
        keys: list[Key],
        n: int | None,
        workers: Iterable[str] | None,
        delete: bool,
        stimulus_id: str | None,
        max_rounds: int = 3,
    ) -> list[Key]:
        s = self.scheduler
        assert s is not None
        from distributed.core import Status

        stimulus_id = stimulus_id or "hoplite-replicate"
        async with s._replica_lock(("replicate", object())):
            if workers is not None:
                pool = {s.workers[w] for w in s.workers_list(list(workers))}
                pool = {ws for ws in pool if ws.status == Status.running}
            else:
                pool = set(s.running)
            n = len(pool) if n is None else min(n, len(pool))
            if n == 0:
                raise ValueError("Can not use replicate to delete data")
            tasks = [s.tasks[k] for k in keys]
            lost = [ts.key for ts in tasks if not ts.who_has]
            if lost:
                return lost

            if delete:
                drop: defaultdict[WorkerState, list[Key]] = defaultdict(list)
                for ts in tasks:
                    have = tuple(ts.who_has or ()) if ts.who_has else ()
                    have = tuple(ws for ws in have if ws in pool)
                    if len(have) > n:
                        for ws in random.sample(have, len(have) - n):
                            drop[ws].append(ts.key)
                await asyncio.gather(
                    *(s.delete_worker_data(ws.address, ks, stimulus_id) for ws, ks in drop.items())
                )

            # Replicas this call achieved: later AMM drops do not undo them.
            achieved = {ts.key: {ws for ws in (ts.who_has or ()) if ws in pool} for ts in tasks}
            for _ in range(max_rounds):
                gathers: defaultdict[str, dict[Key, list[str]]] = defaultdict(dict)
                for ts in tasks:
                    if ts.state != "memory" or not ts.who_has:
                        continue
                    missing = n - len(achieved[ts.key])
                    if missing <= 0:
                        continue
                    free = [ws for ws in pool - achieved[ts.key] - set(ts.who_has)]
                    holders = [ws.address for ws in ts.who_has]
                    for ws in random.sample(free, min(missing, len(free))):
                        gathers[ws.address][ts.key] = holders
                if not gathers:
                    break
                for addr, who_has in gathers.items():
                    for k, holders in who_has.items():
                        self._replicating[k].update(holders)
                        self._replicating[k].add(addr)
                try:
                    failed_per_worker = await asyncio.gather(
                        *(s.gather_on_worker(addr, wh) for addr, wh in gathers.items())
                    )
                finally:
                    for who_has in gathers.values():
                        for k in who_has:
                            self._replicating.pop(k, None)
                for (addr, who_has), failed in zip(gathers.items(), failed_per_worker, strict=True):
                    target = s.workers.get(addr)
                    for k in who_has:
                        if k not in failed and target is not None:
                            achieved[k].add(target)
            return [ts.key for ts in tasks if len(achieved[ts.key]) < n and ts.state == "memory"]
