"""The repair ``hoplite.reduce.repair: spread`` (the default in a reduce in
parts), modelled: a dead node is not replaced, it is *spread*.

:class:`~benchmarks.simulator.reduce.HopliteReduce` models the other repair,
the real code's in one tree (``worker/reduce_root.py``): a new node on the
worker W where the scheduler recomputed the dead node's input. In split trees
every NIC is full, so W then carries twice its load each way, and every tree
through W runs at half rate until the end. Here instead, when node ``v`` dies and its parent ``p`` has
its stream up to byte ``b``:

- W's own node adds the recomputed input into the stream it already sends, from
  the byte that stream has reached, ``e_W = max(b, sent_W)``: W's uplink carries
  no second copy. Bytes ``[b, e_W)`` of the input go to ``p`` as a *patch*, a
  stream that ends before the object does.
- Each child ``c`` of ``v`` is adopted by the live inner node ``A`` of the tree
  (only inner nodes combine streams), outside ``v``'s subtree (so no cycle),
  whose worker receives the fewest streams over every segment's tree (ties:
  seeded random). ``A`` adds ``c``'s partial sums from the byte it has
  sent, ``e_c = max(b, sent_A)``, and waits there for ``c``'s stream; ``c``
  sends ``[b, e_c)`` to ``p`` as a patch and ``[e_c, S)`` to ``A``.
- ``p`` combines the patches in ``v``'s place.

Who adopts whom, and which patches ``p`` reads, are decided by the library's
own sans-IO :class:`~dask_hoplite.core.tree_spread.LiveTree`, from what the
root of the reduction would know: the tree shapes of every segment, not the
network's flows.

The dead worker's load (its children's streams in, its own out) is spread over
about k + 1 workers, one stream of S/k more each. The workers do it as
``worker/tree_spreader.py``, ``worker/reduce_node.py`` and ``worker/combine.py``
describe.

Not modelled: a worker dying while it sends or receives a patch (a patch lasts
a few blocks), or a node and its parent dying before the first is spread. Such
a failure is counted in :attr:`SpreadReduce.unmodelled`, and the run then
raises, as it cannot complete.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from benchmarks.simulator.network import EPS, Buffer, Flow
from benchmarks.simulator.reduce import HopliteReduce
from dask_hoplite.core.tree_spread import LiveTree, worker_load
from dask_hoplite.errors import SpreadRefused


class SpreadReduce(HopliteReduce):
    """One (segment) tree whose dead nodes are spread, not replaced."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tie = random.Random(f"{self.seed}:{self.segment}")
        self.live = LiveTree(self.tree.parent)
        #: The patches each node sends (to a dead node's parent), by sender.
        self.patches: dict[int, list[Flow]] = {}
        #: Each spread: (dead node, byte its parent reached, {child: adopter}).
        self.spreads: list[tuple[int, float, dict[int, int]]] = []
        self.unmodelled = 0

    @property
    def gone(self) -> set[int]:
        """Nodes spread since the start."""
        return self.live.gone

    def check_complete(self) -> None:
        if self.unmodelled:
            raise RuntimeError(f"{self.unmodelled} failures this model does not cover")
        super().check_complete()

    def _start(self, hosts: list[str], now: float) -> None:
        self.patches = {}
        self.spreads = []
        super()._start(hosts, now)
        self.live = LiveTree(self.tree.parent)
        self.parent = self.live.parent  # one list: the streams follow the spreads

    def _root_complete(self) -> bool:
        return all(b.complete for b in self.sources[self.tree.root])

    def _finish_if_complete(self, now: float) -> None:
        if self.remaining and self._root_complete():
            self.remaining.clear()
            self.outcome.seconds = now

    def _done(self, v: int, flow: Flow, now: float) -> None:
        self._finish_if_complete(now)

    def _patch_done(self, flow: Flow, now: float) -> None:
        self._finish_if_complete(now)

    def _fail(self, worker: str, now: float) -> None:
        cut = self._kill(worker)
        if cut is None:
            return
        patches = {f for fs in self.patches.values() for f in fs}
        self.unmodelled += sum(1 for f in cut if f in patches)  # a patch cut short
        for v, h in enumerate(self.host):
            if h == worker and v not in self.gone:
                self.engine.at(
                    now + self.cluster.overheads.setup + self.recompute, partial(self._spread, v)
                )

    def _sent(self, u: int, b: float) -> float:
        """The byte from which node ``u`` adds a new operand to its stream
        (what the node itself would pick)."""
        if u == self.tree.root or self.recv[u].pos <= b + EPS:
            return b
        return self.recv[u].pos

    def _patch(
        self, src: int, dst: int, into: Buffer, start: float, sources: tuple[Buffer, ...]
    ) -> None:
        """``src`` sends bytes [``into.pos``, ``into.size``) to ``dst``."""
        flow = Flow(
            self.host[src],
            self.host[dst],
            into,
            sources=sources,
            lag=self.cluster.lag(self.size, self.streams),
            start=start,
            on_done=self._patch_done,
        )
        self.net.add(flow)
        self.patches.setdefault(src, []).append(flow)

    def _restream(self, u: int, now: float) -> None:
        """Node ``u``'s streams (to its parent, and its patches) with its
        sources changed."""
        old = self.outflow[u]
        if old is not None:
            self.net.remove(old)
            self.outflow[u] = None
        parent = self.parent[u]
        if parent is not None and self.host[parent] not in self.dead:
            self._stream(u, now)  # else: u is adopted when its parent is spread
        live = []
        for f in self.patches.get(u, ()):
            if f in self.net.flows and f.sources:
                self.net.remove(f)
                f = Flow(f.src, f.dst, f.into, tuple(self.sources[u]), f.lag, now, f.on_done)
                self.net.add(f)
            live.append(f)
        self.patches[u] = live

    def _spread(self, v: int, now: float) -> None:
        if not self.remaining:
            return
        b = self.recv[v].pos
        # The recomputed input joins its new worker's own node.
        worker = self._surviving_worker()
        w = next(u for u, h in enumerate(self.host) if h == worker and u not in self.gone)
        # What the root knows: the streams into each worker over every tree.
        trees = [(t.live, t.host) for t in self.siblings if isinstance(t, SpreadReduce)]
        into = worker_load(trees)
        # Only inner nodes combine streams, so only they adopt (as built).
        inner = {u: into[self.host[u]] for u in self.live.inner() if self.host[u] not in self.dead}
        down = [u for u, h in enumerate(self.host) if h in self.dead]
        try:
            plan = self.live.plan_spread(v, b, w, inner, down, rng=self.tie)
        except SpreadRefused:
            self.unmodelled += 1
            return
        self.outcome.repairs += 1
        p = plan.parent
        start = now + self.cluster.overheads.setup
        # Each adopter picks the byte from which it adds its child; the input
        # joins w where w's stream has got to.
        adopted_from = {c: self._sent(a, b) for c, a in plan.adopters}
        patches = plan.patches(self._sent(w, b), adopted_from)
        into_p: list[Buffer] = []
        for patch in patches:
            buf = Buffer(patch.end, pos=patch.start)
            into_p.append(buf)
            sources = () if patch.input else tuple(self.sources[patch.src])
            self._patch(patch.src, p, buf, start, sources)
        self.spreads.append((v, b, dict(plan.adopters)))
        for c, a in plan.adopters:
            old = self.outflow[c]
            if old is not None:
                self.net.remove(old)
            self.recv[c] = Buffer(self.size, pos=adopted_from[c])
            self.parent[c] = a  # as LiveTree.apply records it
            self.sources[a].append(self.recv[c])
            self._stream(c, start)
            self._restream(a, now)
        self.live.apply(plan)
        dead = self.recv[v]
        self.sources[p] = [x for x in self.sources[p] if x is not dead]
        self.sources[p] += into_p
        self._restream(p, now)
        self._finish_if_complete(now)
