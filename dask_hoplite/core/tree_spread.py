"""Spreading a dead node of a running reduce tree over the live ones: the
decisions, sans-IO.

One running tree is repaired by default by *replacing* a dead node
(:mod:`dask_hoplite.core.tree_repair`): a new node for its input starts on the
worker W where Dask recomputed that input, and the dead node's children and
parent stream to it. In split trees (``reduce(..., parts=k)``) every NIC is
already full, so W then carries twice its load each way and every tree through
W runs at half rate until the end: 2.3x of S/B at 1,024 workers with 1% of them
failing (``docs/benchmark-log.md``). A *spread* gives no worker a second stream.
When node ``v`` dies and its parent ``p`` had its stream up to byte ``b``:

- W's own node of the tree adds the recomputed input into the stream it
  already sends, from a byte ``e_W >= b`` that node has not produced yet;
  bytes ``[b, e_W)`` of the input go to ``p`` as a :class:`Patch` (a stream
  with an end).
- Each child ``c`` of ``v`` is adopted by a live inner node ``A`` (only inner
  nodes combine streams) outside ``v``'s subtree (so no cycle forms), the one
  whose worker receives the fewest streams (over every tree the root runs). ``A`` adds ``c``'s stream from a
  byte ``e_c >= b`` it has not produced yet; ``c`` sends ``[b, e_c)`` to ``p``
  as a patch.
- ``p`` combines the patches in ``v``'s place.

The bytes before ``b`` need nothing: they reached ``p`` through ``v``.

:class:`LiveTree` is the root's view of one tree as it is spread:
:meth:`LiveTree.plan_spread` decides who adopts whom (the adopters then pick
their bytes, which only they know), :meth:`SpreadPlan.patches` turns those
bytes into the patches ``p`` reads, and :meth:`LiveTree.apply` records the
new shape. No IO: :class:`~dask_hoplite.core.tree_repair.TreeRepair` asks
for the plans and decides (in a reduce in parts by default, or everywhere with
``hoplite.reduce.repair: spread``), the root's worker carries them out
(:mod:`dask_hoplite.worker.tree_spreader`), and the simulator
(``benchmarks/simulator/spread_repair.py``) drives them too.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from dask_hoplite.errors import SpreadRefused


@dataclass(frozen=True)
class Patch:
    """Bytes ``[start, end)`` from node ``src`` to node ``dst``, which
    combines them in a dead node's place: ``src``'s stream (a dead node's
    child, before its adopter took it over) or, with ``input``, the dead
    node's recomputed input held by ``src``'s worker."""

    src: int
    dst: int
    start: float
    end: float
    input: bool = False


@dataclass(frozen=True)
class SpreadPlan:
    """How dead node ``dead`` is spread: ``parent`` had its stream up to byte
    ``offset``; node ``merge_into`` (on the worker holding the recomputed
    input) adds that input; ``adopters`` maps each of ``dead``'s children to
    the node that takes its stream over."""

    dead: int
    parent: int
    offset: float
    merge_into: int
    adopters: tuple[tuple[int, int], ...]  # (child, adopter), children in order

    def patches(self, merged_from: float, adopted_from: Mapping[int, float]) -> list[Patch]:
        """The patches ``parent`` reads, given the byte from which
        ``merge_into`` added the input (``merged_from``) and each adopter its
        child (``adopted_from``, by child); each is ``>= offset``. A node that
        starts at ``offset`` itself needs no patch."""
        starts = [merged_from, *(adopted_from[c] for c, _ in self.adopters)]
        if any(s < self.offset for s in starts):
            raise ValueError(f"a spread starts at or after byte {self.offset}, got {starts}")
        out = []
        if merged_from > self.offset:
            out.append(Patch(self.merge_into, self.parent, self.offset, merged_from, input=True))
        for c, _ in self.adopters:
            if adopted_from[c] > self.offset:
                out.append(Patch(c, self.parent, self.offset, adopted_from[c]))
        return out


class LiveTree:
    """One running reduce tree as spreads change it: each node's parent now,
    and the nodes spread away (``gone``). Built from the planned parent links
    (``ReduceSpec.parent``, ``ReduceTree.parent``)."""

    def __init__(self, parent: Sequence[int | None]) -> None:
        roots = [v for v, p in enumerate(parent) if p is None]
        if len(roots) != 1:
            raise ValueError(f"a tree has one root, got {len(roots)}")
        self.parent: list[int | None] = list(parent)
        self.root = roots[0]
        self.gone: set[int] = set()

    def children(self, v: int) -> list[int]:
        """``v``'s children now, in node order."""
        return [u for u, p in enumerate(self.parent) if p == v and u not in self.gone]

    def subtree(self, v: int) -> set[int]:
        """``v`` and every node below it now."""
        below: dict[int, list[int]] = collections.defaultdict(list)
        for u, p in enumerate(self.parent):
            if p is not None and u not in self.gone:
                below[p].append(u)
        seen, stack = set(), [v]
        while stack:
            u = stack.pop()
            if u not in seen:
                seen.add(u)
                stack.extend(below[u])
        return seen

    def inner(self) -> set[int]:
        """The nodes with a live child now: the ones that combine streams,
        so the only ones that can adopt."""
        return set(self.inflow())

    def inflow(self) -> collections.Counter[int]:
        """Streams into each node now: one per live child."""
        return collections.Counter(
            p for u, p in enumerate(self.parent) if p is not None and u not in self.gone
        )

    def plan_spread(
        self,
        dead: int,
        offset: float,
        merge_into: int,
        load: Mapping[int, int],
        down: Collection[int] = (),
        rng: random.Random | None = None,
    ) -> SpreadPlan:
        """How to spread ``dead``, whose parent had its stream up to byte
        ``offset``, with the recomputed input joining node ``merge_into``.

        ``load``: the streams into each candidate adopter's worker (over every
        tree: :func:`worker_load`); a node missing from it is not a candidate
        (its worker is dead, say). ``down``: nodes whose worker is dead now.
        Each child goes to the least loaded candidate outside ``dead``'s
        subtree, counted one stream more once chosen; ties go to the lowest
        node, or a ``rng`` choice. Raises :class:`SpreadRefused` where a
        spread cannot help: the root died, the parent or a child died too, or
        no node can adopt."""
        if dead == self.root:
            raise SpreadRefused("the root of a reduce tree is not spread (its task is rerun)")
        if dead in self.gone:
            raise SpreadRefused(f"node {dead} was spread already")
        parent = self.parent[dead]
        assert parent is not None
        if parent in down:
            raise SpreadRefused(f"node {dead}'s parent {parent} is dead too")
        if merge_into == dead or merge_into in self.gone or merge_into in down:
            raise SpreadRefused(f"node {merge_into} cannot take node {dead}'s input")
        children = self.children(dead)
        if dead_children := [c for c in children if c in down]:
            raise SpreadRefused(f"node {dead}'s children {dead_children} are dead too")
        inside = self.subtree(dead)
        free = {
            u: n
            for u, n in load.items()
            if u not in inside and u not in self.gone and u not in down
        }
        if children and not free:
            raise SpreadRefused(f"no live node outside node {dead}'s subtree can adopt")
        adopters = []
        for c in children:
            least = min(free.values())
            ties = sorted(u for u, n in free.items() if n == least)
            a = rng.choice(ties) if rng is not None else ties[0]
            free[a] += 1
            adopters.append((c, a))
        return SpreadPlan(dead, parent, offset, merge_into, tuple(adopters))

    def apply(self, plan: SpreadPlan) -> None:
        """Record ``plan``: its dead node is gone, its children moved."""
        for c, a in plan.adopters:
            self.parent[c] = a
        self.gone.add(plan.dead)


def worker_load(trees: Iterable[tuple[LiveTree, Sequence[str]]]) -> collections.Counter[str]:
    """Streams into each worker over ``trees`` (each with the worker running
    each of its nodes): what a root running every segment tree of a
    reduction knows of its workers' downlinks."""
    out: collections.Counter[str] = collections.Counter()
    for tree, hosts in trees:
        for v, n in tree.inflow().items():
            out[hosts[v]] += n
    return out
