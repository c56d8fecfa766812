"""Reduce of one object per worker into one root, shaped by the real planner
(:func:`~dask_hoplite.core.tree_shape.plan_reduce_tree` with Hoplite's
:func:`~dask_hoplite.core.tree_shape.max_chain_length`) and repaired with the real
:class:`~dask_hoplite.core.tree_repair.TreeRepair`; and Dask's one-task reduce
(every input fetched into one worker) for comparison.

Every tree edge carries the whole object, pipelined: a node's stream to its
parent forwards the sum of its children's streams, so it stays a block behind
the slowest of them. As in :func:`dask_hoplite.reduce`, the tree is planned
once every input is ready (inputs fill the slots in the order they became
ready, the first farthest from the root).

Failures follow ``tree_repair.py`` and ``worker/reduce_root.py``: a dead
node's parent sees its stream break at once and asks the root for a
replacement (one setup latency); the root starts the node where the input is
held again: the scheduler recomputes the lost input, in ``recompute`` seconds,
on a surviving worker (chosen at random: every worker already runs a node, so
that host's NIC then carries two streams each way). The replacement starts at
the byte the parent reached and the dead node's children re-send it their
partial sums from there; every other node streams on. A tree takes at most
``budget`` (``hoplite.resume-attempts``) replacements; the next failure breaks
it and the whole reduction restarts from byte 0 with the same shape and every
input located again (``colocated_order`` puts a recomputed input next to the
one its worker already holds). The root's worker is assumed not to fail (its
task would be rerun by Dask).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from functools import partial

from benchmarks.simulator.broadcast import Outcome
from benchmarks.simulator.engine import Engine
from benchmarks.simulator.network import Buffer, Flow, Network
from benchmarks.simulator.params import Cluster, address
from dask_hoplite.core.reduce_plan import split_tree_specs
from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_repair import (
    CheckNode,
    Closed,
    FindHolder,
    HolderFound,
    NodeChecked,
    NodeLost,
    RepairAsked,
    Replace,
    TreeRepair,
)
from dask_hoplite.core.tree_shape import (
    ReduceTree,
    colocated_order,
    max_chain_length,
    plan_reduce_tree,
)


def ready_times(workers: list[str], arrivals: Mapping[str, float] | None) -> dict[str, float]:
    """When each worker's input is ready (all at t=0 without ``arrivals``)."""
    return {w: 0.0 if arrivals is None else arrivals[w] for w in workers}


class HopliteReduce:
    """One reduction of ``n_workers`` inputs, one per worker."""

    def __init__(
        self,
        cluster: Cluster,
        n_workers: int,
        size: float,
        planner_bandwidth: float | None = None,
        planner_latency: float | None = None,
        recompute: float = 0.0,
        budget: int = 8,
        seed: int = 0,
        tree: ReduceTree | None = None,
        engine: Engine | None = None,
        streams: int = 1,
        segment: int = 0,
    ) -> None:
        self.cluster = cluster
        self.segment = segment  # which segment's tree, in a reduce in parts
        self.size = size
        self.recompute = recompute
        self.budget = budget
        self.streams = streams  # streams sharing a NIC (segment trees)
        self.seed = seed
        self.rng = random.Random(seed)
        # The planner is given what the network model would measure: the
        # per-host throughput and the latency of one block per hop.
        bw = planner_bandwidth or cluster.rate
        lat = planner_latency or cluster.block(size) / cluster.rate + cluster.overheads.hop_latency
        self.tree = tree or plan_reduce_tree(n_workers, max_chain_length(int(size), bw, lat))
        self.engine = engine or Engine(Network(cluster.rate))
        self.net = self.engine.net
        self.workers = [address(i) for i in range(n_workers)]
        self.dead: set[str] = set()
        self.host: list[str] = []  # worker running each node now
        self.recv: list[Buffer] = []  # node's stream on its parent's worker
        self.parent: list[int | None] = []  # each node's parent now
        self.sources: list[list[Buffer]] = []  # the streams each node combines now
        self.outflow: list[Flow | None] = []  # each node's stream to its parent
        self.remaining: set[int] = set()  # root's children not complete
        self.outcome = Outcome(0.0, depth=self.tree.height())
        self.repair: TreeRepair | None = None
        #: The trees of this reduction, sharing its network (a reduce in parts).
        self.siblings: list[HopliteReduce] = [self]

    def run(
        self,
        arrivals: Mapping[str, float] | None = None,
        failures: Mapping[str, float] | None = None,
    ) -> Outcome:
        ready = ready_times(self.workers, arrivals)
        # Slots in the order inputs became ready (in-order numbering = fill order).
        index = {w: i for i, w in enumerate(self.workers)}
        by_ready = sorted(self.workers, key=lambda w: (ready[w], index[w]))
        t0 = max(ready.values())
        self.engine.at(t0, partial(self._start, by_ready))
        for w, t in (failures or {}).items():
            self.engine.at(t, partial(self._fail, w))
        self.engine.run()
        self.check_complete()
        self.outcome.events = self.engine.events
        return self.outcome

    def check_complete(self) -> None:
        """Raise unless the reduction reached its root."""
        if self.remaining or not self.host:
            raise RuntimeError("the reduction did not complete")

    def host_of_node_before_start(self, node: int) -> str:
        """The worker node ``node`` runs on when every input is ready at t=0."""
        return self.workers[node]

    @property
    def root_worker(self) -> str:
        return self.host[self.tree.root]

    def _spec(self) -> ReduceSpec:
        return ReduceSpec(
            rid="sim",
            op="sum",
            inputs=tuple(range(self.tree.n)),
            addresses=tuple(self.host),
            parent=self.tree.parent,
            shape=(),
            dtype="",
            block_bytes=self.cluster.block_bytes,
        )

    def _start(self, hosts: list[str], now: float) -> None:
        """Run the whole tree from byte 0 with node ``i`` on ``hosts[i]``."""
        self.host = list(hosts)
        self.repair = TreeRepair(self._spec(), budget=self.budget, grace=60.0)
        self.recv = [Buffer(self.size) for _ in range(self.tree.n)]
        self.parent = list(self.tree.parent)
        self.sources = [self._child_streams(v) for v in range(self.tree.n)]
        self.outflow = [None] * self.tree.n
        self.remaining = set(self.tree.children(self.tree.root))
        start = now + self.cluster.overheads.setup
        for v in range(self.tree.n):
            if v != self.tree.root:
                self._stream(v, start)
        if not self.remaining:
            self.outcome.seconds = now

    def _child_streams(self, v: int) -> list[Buffer]:
        """The streams of node ``v``'s children in the planned tree."""
        return [self.recv[c] for c in self.tree.children(v)]

    def _stream(self, v: int, start: float) -> None:
        """Node ``v`` streams the sum of its children's streams to its parent."""
        parent = self.parent[v]
        assert parent is not None
        flow = Flow(
            self.host[v],
            self.host[parent],
            self.recv[v],
            sources=tuple(self.sources[v]),
            lag=self.cluster.lag(self.size, self.streams),
            start=start,
            on_done=partial(self._done, v),
        )
        self.net.add(flow)
        self.outflow[v] = flow

    def _done(self, v: int, flow: Flow, now: float) -> None:
        if flow.into is not self.recv[v]:
            return  # a stream of a tree that was restarted since
        self.remaining.discard(v)
        if not self.remaining:
            self.outcome.seconds = now
            assert self.repair is not None
            self.repair.handle(Closed())

    def _kill(self, worker: str) -> list[Flow] | None:
        """``worker`` dies: its streams are cut (returned). None if that
        changes nothing (it is dead already, or the reduction is over)."""
        if worker in self.dead or not self.remaining:
            return None
        if worker == self.root_worker:
            raise ValueError("the simulator assumes the root's worker does not fail")
        self.dead.add(worker)
        return self.net.remove_host(worker)

    def _fail(self, worker: str, now: float) -> None:
        if self._kill(worker) is None:
            return
        repair = self.repair
        assert repair is not None
        for v in [v for v, h in enumerate(self.host) if h == worker]:
            # The root's call to the node breaks, its parent asks for a
            # repair, and the root's call says the worker died.
            lost = NodeLost(v, repair.generation.get(v, 0), unreachable=True, now=now)
            decisions = repair.handle(lost)  # nothing: wait for the parent
            if not decisions:
                decisions = repair.handle(RepairAsked(v, offset=int(self.recv[v].pos), dead=worker))
            if decisions and isinstance(decisions[0], CheckNode):
                decisions = repair.handle(NodeChecked(v, failure=None))
            if not (len(decisions) == 1 and isinstance(decisions[0], FindHolder)):
                self._restart(now)  # refused, or the tree broke
                return
            # The input is recomputed.
            self.engine.at(
                now + self.cluster.overheads.setup + self.recompute,
                partial(self._replace, v, repair),
            )

    def _replace(self, v: int, repair: TreeRepair, now: float) -> None:
        if repair is not self.repair or repair.closed:
            return
        [replace] = repair.handle(HolderFound(v, self._surviving_worker(), load={}))
        assert isinstance(replace, Replace), replace
        self.host[v] = replace.address
        self.outcome.repairs += 1
        offset = self.recv[v].pos
        start = now + self.cluster.overheads.setup
        for c in self.tree.children(v):
            # The dead node's children re-send their partial sums from the
            # byte its parent reached.
            self.recv[c] = Buffer(self.size, pos=offset)
            if self.host[c] not in self.dead:
                self._stream(c, start)
        self.sources[v] = self._child_streams(v)
        parent = self.tree.parent[v]
        assert parent is not None
        if self.host[parent] not in self.dead:
            self._stream(v, start)

    def _restart(self, now: float) -> None:
        """The tree broke beyond repair: every input located again, from byte 0."""
        assert self.repair is not None
        self.repair.handle(Closed())
        self.outcome.seconds = 0.0
        for f in list(self.net.flows):
            self.net.remove(f)
        # Where each slot's input is now: its worker, or one that recomputed it.
        holders = [h if h not in self.dead else self._surviving_worker() for h in self.host]
        order = colocated_order(self.tree.parent, holders, self.tree.root)
        hosts = [holders[i] for i in order]
        self.outcome.resumes += 1  # counted as a restart of the whole tree
        self.engine.at(now + self.recompute, partial(self._start, hosts))

    def _surviving_worker(self) -> str:
        alive = [w for w in self.workers if w not in self.dead]
        return self.rng.choice(alive)


class SplitReduce:
    """A reduction in ``parts`` segments, each up its own tree, as
    ``dask_hoplite.reduce(..., parts=k)``: the trees of the real
    :func:`~dask_hoplite.core.reduce_plan.split_tree_specs`, rooted at worker
    0, one :class:`HopliteReduce` of ``size / parts`` bytes each, sharing one
    network. Each tree repairs its own nodes; the reduction ends when the
    last segment reaches the root."""

    def __init__(
        self,
        cluster: Cluster,
        n_workers: int,
        size: float,
        parts: int,
        tree_class: type[HopliteReduce] | None = None,
        **kw: float,
    ):
        # replaced; simulate.py passes the library's default for parts (spread)
        tree_class = tree_class or HopliteReduce
        workers = [address(i) for i in range(n_workers)]
        specs = split_tree_specs("sim", "sum", workers, workers, 0, parts, cluster.block_bytes)
        self.engine = Engine(Network(cluster.rate))
        self.trees = []
        for j, spec in enumerate(specs):
            tree = ReduceTree.of(spec.parent)
            self.trees.append(
                tree_class(
                    cluster,
                    n_workers,
                    size / parts,
                    tree=tree,
                    engine=self.engine,
                    streams=parts,
                    segment=j,
                    **kw,  # type: ignore[arg-type]
                )
            )
        for r in self.trees:
            r.siblings = self.trees
        self.workers = workers

    def run(
        self,
        arrivals: Mapping[str, float] | None = None,
        failures: Mapping[str, float] | None = None,
    ) -> Outcome:
        t0 = max(ready_times(self.workers, arrivals).values())  # planned once all are ready
        for r in self.trees:
            self.engine.at(t0, partial(r._start, list(self.workers)))
        for w, t in (failures or {}).items():
            for r in self.trees:
                self.engine.at(t, partial(r._fail, w))
        self.engine.run()
        outs = [r.outcome for r in self.trees]
        for r in self.trees:
            r.check_complete()
        return Outcome(
            max(o.seconds for o in outs),
            resumes=sum(o.resumes for o in outs),
            repairs=sum(o.repairs for o in outs),
            events=self.engine.events,
            depth=max(r.tree.height() for r in self.trees),
        )


def hoplite_reduce(
    cluster: Cluster,
    n_workers: int,
    size: float,
    arrivals: Mapping[str, float] | None = None,
    failures: Mapping[str, float] | None = None,
    **kw: float,
) -> Outcome:
    return HopliteReduce(cluster, n_workers, size, **kw).run(arrivals, failures)  # type: ignore[arg-type]


def dask_reduce(cluster: Cluster, n_workers: int, size: float) -> Outcome:
    """Dask's one-task reduce: the root fetches every other input at once
    (``distributed.worker.connections.outgoing`` is 50), sharing its downlink."""
    net = Network(cluster.rate)
    engine = Engine(net)
    out = Outcome(0.0, depth=1)
    root = address(0)

    def done(f: Flow, now: float) -> None:
        out.finish[f.src] = now

    for i in range(1, n_workers):
        src = address(i)
        net.add(
            Flow(
                src,
                root,
                Buffer(size),
                start=cluster.overheads.setup,
                on_done=done,
            )
        )
    engine.run()
    out.seconds = max(out.finish.values())
    out.events = engine.events
    return out
