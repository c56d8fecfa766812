"""A repair of reduce trees that dask-hoplite does not have yet, modelled to see
whether it is worth building: a dead node is not replaced, it is *spread*.

:class:`~benchmarks.simulator.reduce.HopliteReduce` models the repair the real
code does (``worker/reduce_root.py``): a new node on the worker W where the
scheduler recomputed the dead node's input. In split trees every NIC is full, so
W then carries twice its load each way, and every tree through W runs at half
rate until the end. Here instead, when node ``v`` dies and its parent ``p`` has
its stream up to byte ``b``:

- W's own node adds the recomputed input into the stream it already sends, from
  the byte that stream has reached, ``e_W = max(b, sent_W)``: W's uplink carries
  no second copy. Bytes ``[b, e_W)`` of the input go to ``p`` as a *patch*, a
  stream that ends before the object does.
- Each child ``c`` of ``v`` is adopted by the live node ``A`` of the tree, outside
  ``v``'s subtree (so no cycle), whose worker receives the fewest streams now
  (ties: seeded random). ``A`` adds ``c``'s partial sums from the byte it has
  sent, ``e_c = max(b, sent_A)``, and waits there for ``c``'s stream; ``c``
  sends ``[b, e_c)`` to ``p`` as a patch and ``[e_c, S)`` to ``A``.
- ``p`` combines the patches in ``v``'s place.

The dead worker's load (its children's streams in, its own out) is spread over
about k + 1 workers, one stream of S/k more each. What the real code would need
for this: a node that gains an input or a child mid-stream at a byte it picks,
a stream with an end, and a root that knows every host's streams across the
segment trees.

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


class SpreadReduce(HopliteReduce):
    """One (segment) tree whose dead nodes are spread, not replaced."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tie = random.Random(f"{kw.get('seed', 0)}:{self.segment}")
        self.gone: set[int] = set()  # nodes spread since the start
        #: The patches each node sends (to a dead node's parent), by sender.
        self.patches: dict[int, list[Flow]] = {}
        #: Each spread: (dead node, byte its parent reached, {child: adopter}).
        self.spreads: list[tuple[int, float, dict[int, int]]] = []
        self.unmodelled = 0

    def check_complete(self) -> None:
        if self.unmodelled:
            raise RuntimeError(f"{self.unmodelled} failures this model does not cover")
        super().check_complete()

    def _start(self, hosts: list[str], now: float) -> None:
        self.gone = set()
        self.patches = {}
        self.spreads = []
        super()._start(hosts, now)

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

    def _subtree(self, v: int) -> set[int]:
        children: dict[int, list[int]] = {}
        for u, p in enumerate(self.parent):
            if p is not None and u not in self.gone:
                children.setdefault(p, []).append(u)
        seen, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u not in seen:
                seen.add(u)
                stack.extend(children.get(u, ()))
        return seen

    def _sent(self, u: int, b: float) -> float:
        """The byte from which node ``u`` can add a new operand to its stream."""
        return b if u == self.tree.root else max(b, self.recv[u].pos)

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
        p = self.parent[v]
        assert p is not None
        if self.host[p] in self.dead:
            self.unmodelled += 1
            return
        self.outcome.repairs += 1
        b = self.recv[v].pos
        start = now + self.cluster.overheads.setup
        patches: list[Buffer] = []
        # The recomputed input joins its new worker's own node; the bytes that
        # node has sent without it go to p (from a complete local copy).
        worker = self._surviving_worker()
        w = next(u for u, h in enumerate(self.host) if h == worker and u not in self.gone)
        end = self._sent(w, b)
        if end > b + EPS:
            patches.append(Buffer(end, pos=b))
            self._patch(w, p, patches[-1], start, ())
        # Its children go to the least loaded nodes outside its subtree.
        inside = self._subtree(v)
        load = {
            u: self.net.flows_into(h)
            for u, h in enumerate(self.host)
            if u not in inside and u not in self.gone and h not in self.dead
        }
        adopted: dict[int, int] = {}
        self.spreads.append((v, b, adopted))
        for c in [u for u, q in enumerate(self.parent) if q == v and u not in self.gone]:
            if self.host[c] in self.dead:
                self.unmodelled += 1
                continue
            least = min(load.values())
            a = self.tie.choice(sorted(u for u, n in load.items() if n == least))
            load[a] += 1
            adopted[c] = a
            end = self._sent(a, b)
            old = self.outflow[c]
            if old is not None:
                self.net.remove(old)
            if end > b + EPS:
                patches.append(Buffer(end, pos=b))
                self._patch(c, p, patches[-1], start, tuple(self.sources[c]))
            self.recv[c] = Buffer(self.size, pos=end)
            self.parent[c] = a
            self.sources[a].append(self.recv[c])
            self._stream(c, start)
            self._restream(a, now)
        dead = self.recv[v]
        self.gone.add(v)
        self.sources[p] = [x for x in self.sources[p] if x is not dead]
        self.sources[p] += patches
        self._restream(p, now)
        self._finish_if_complete(now)
