"""Repair of a running reduce tree whose node died: a state machine, sans-IO.

When a node's worker dies, the node's parent asks the root for a repair
(``hoplite_reduce_replace``). The root either *replaces* the node (a new node
for the same input starts on a worker that holds it, Dask recomputing a lost
input from its lineage; it starts at the byte the parent reached, the dead
node's children serve it from the partial results they still hold, and only
the path to the root carries the rest of the object again), or *spreads* it
over the live nodes (:mod:`dask_hoplite.core.tree_spread`: no worker takes a
second stream, which matters in split trees, where every NIC is full). A
restart of the whole tree would carry all of the object through every node.

:class:`TreeRepair` is the root's repair state for one tree, and the one place
where repair is decided. The root's worker (:mod:`dask_hoplite.worker.reduce_root`)
feeds it events (:class:`NodeLost`, :class:`RepairAsked`, and the
observations the decisions ask for) through :meth:`TreeRepair.handle` and
carries out the decisions it returns:

======================  =====================================================
event                   decisions
======================  =====================================================
NodeLost                nothing (the parent will ask), :class:`BreakTree`
RepairAsked             :class:`Refuse`, :class:`CheckNode`
NodeChecked             :class:`Refuse`, :class:`FindHolder`
HolderFound             :class:`Refuse`, :class:`Replace`, :class:`Spread`
HolderMissing           :class:`Refuse`
SpreadAnswered          :class:`Patches`
SpreadFailed            :class:`Refuse`
RepairAborted           nothing; the node waits for a request again
Tick                    :class:`BreakTree` (dead nodes nobody asked for)
Closed                  nothing; every later request is refused
======================  =====================================================

A request (:class:`RepairAsked`) ends in exactly one :class:`Refuse`,
:class:`Replace` or :class:`Patches`, each the reply to the parent.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from dask.typing import Key

from dask_hoplite.core.reduce_spec import ReduceSpec
from dask_hoplite.core.tree_spread import LiveTree, Patch, SpreadPlan, worker_load
from dask_hoplite.errors import SpreadRefused

# ---------------------------------------------------------------- events


@dataclass(frozen=True)
class NodeLost:
    """The root's call to node ``slot`` (started as ``generation``) ended in
    an error; ``unreachable``: its worker did not answer at all (likely dead),
    as opposed to the node failing on its own."""

    slot: int
    generation: int
    unreachable: bool
    now: float


@dataclass(frozen=True)
class RepairAsked:
    """Node ``slot`` on worker ``dead`` broke its parent's stream at byte
    ``offset``; the parent asks for a repair."""

    slot: int
    offset: int
    dead: str


@dataclass(frozen=True)
class NodeChecked:
    """What the root's own call to node ``slot`` says (:class:`CheckNode`):
    ``failure`` None if its worker died, else why the node is not dead."""

    slot: int
    failure: str | None


@dataclass(frozen=True)
class HolderFound:
    """Node ``slot``'s input is held by ``holder`` now (:class:`FindHolder`);
    ``load``: the streams into each worker, over every tree of the reduction."""

    slot: int
    holder: str
    load: Mapping[str, int]


@dataclass(frozen=True)
class HolderMissing:
    slot: int
    error: str


@dataclass(frozen=True)
class SpreadAnswered:
    """The nodes asked by :class:`Spread` took the dead node's input and
    children on, from these bytes (the node's size: never)."""

    slot: int
    merged_from: int
    adopted_from: Mapping[int, int]


@dataclass(frozen=True)
class SpreadFailed:
    slot: int
    error: str


@dataclass(frozen=True)
class RepairAborted:
    """The repair of node ``slot`` under way ended without a reply (the
    parent's request was cancelled, or a step raised): the node counts as
    dead and unasked for again."""

    slot: int
    now: float


@dataclass(frozen=True)
class Tick:
    now: float


@dataclass(frozen=True)
class Closed:
    """The root stopped: the result is complete, or the tree failed."""


Event = (
    NodeLost
    | RepairAsked
    | NodeChecked
    | HolderFound
    | HolderMissing
    | SpreadAnswered
    | SpreadFailed
    | RepairAborted
    | Tick
    | Closed
)

# ------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Refuse:
    """Reply to the parent of node ``slot``: no repair (the tree breaks)."""

    slot: int
    reason: str


@dataclass(frozen=True)
class CheckNode:
    """Wait (a stall timeout at most) for the root's own call to node
    ``slot`` and report :class:`NodeChecked`."""

    slot: int
    dead: str


@dataclass(frozen=True)
class FindHolder:
    """Find a worker other than ``avoid`` that holds ``key`` (waiting while
    Dask recomputes it); report :class:`HolderFound` or :class:`HolderMissing`."""

    slot: int
    key: Key
    avoid: str


@dataclass(frozen=True)
class Replace:
    """Start node ``slot`` of ``spec`` on ``address`` from byte ``offset``
    (its call is ``generation``); reply that address to the parent."""

    slot: int
    address: str
    offset: int
    generation: int
    spec: ReduceSpec


@dataclass(frozen=True)
class Spread:
    """Ask ``holder`` to merge the dead node's input into its node and the
    adopters to take its children (``plan``); report :class:`SpreadAnswered`
    or :class:`SpreadFailed`."""

    slot: int
    plan: SpreadPlan
    holder: str


@dataclass(frozen=True)
class Patches:
    """Reply to the parent of spread node ``slot``: the patches it reads in
    the node's place."""

    slot: int
    plan: SpreadPlan
    holder: str
    merged_from: int
    patches: tuple[Patch, ...]


@dataclass(frozen=True)
class BreakTree:
    """Nodes ``slots`` failed beyond repair: the tree fails."""

    slots: tuple[int, ...]


Decision = Refuse | CheckNode | FindHolder | Replace | Spread | Patches | BreakTree


@dataclass
class _Request:
    """A repair under way."""

    offset: int
    dead: str
    spread: Spread | None = None


@dataclass
class TreeRepair:
    """The root's repair state for reduce tree ``spec``.

    ``budget``: repairs each node of the tree may take
    (``hoplite.resume-attempts``; 0: never repaired, as an allreduce's trees).
    Per node, not per tree: a large tree meets failures of distinct workers as
    a matter of course (1% of 1,024), while a node that keeps dying where it
    is replaced (an input that kills its worker) must not loop for ever.
    ``grace``: how long a node that died may wait for its parent's request
    before the tree counts as broken (the parent notices a dead child when its
    stream breaks: at once for a killed process, after a stall timeout for a
    hung one). ``mode``: replace dead nodes, or spread them where a spread is
    possible (and replace them where not, unless a spread changed the tree).
    """

    spec: ReduceSpec
    budget: int
    grace: float
    #: ``"replace"`` or ``"spread"`` (:func:`dask_hoplite.config.resolve_repair`).
    mode: str = "replace"
    #: The tree's shape as spreads change it.
    live: LiveTree = field(init=False)
    used: int = 0  # repairs begun, in all
    #: Repairs begun, per slot.
    used_by_slot: dict[int, int] = field(default_factory=dict)
    #: The root stopped: no more repairs.
    closed: bool = False
    #: Slots whose node died, with the time by which a repair must begin.
    dead: dict[int, float] = field(default_factory=dict)
    #: The repairs under way, by slot.
    requests: dict[int, _Request] = field(default_factory=dict)
    #: The call running each node: raised by every replacement.
    generation: dict[int, int] = field(default_factory=dict)
    #: Workers known to have died while the tree ran.
    dead_workers: set[str] = field(default_factory=set)
    #: Slots spread over the others: nothing runs in their place.
    spread_slots: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.live = LiveTree(self.spec.parent)

    # ---------------------------------------------------------- the one entry

    def handle(self, event: Event) -> list[Decision]:
        """The decisions ``event`` calls for."""
        if isinstance(event, NodeLost):
            return self._node_lost(event)
        if isinstance(event, RepairAsked):
            return self._asked(event)
        if isinstance(event, NodeChecked):
            return self._checked(event)
        if isinstance(event, HolderFound):
            return self._holder_found(event)
        if isinstance(event, (HolderMissing, SpreadFailed)):
            return [self._refuse(event.slot, event.error)]
        if isinstance(event, SpreadAnswered):
            return self._spread_answered(event)
        if isinstance(event, RepairAborted):
            if self.requests.pop(event.slot, None) is not None and not self.closed:
                self.dead.setdefault(event.slot, event.now + self.grace)
            return []
        if isinstance(event, Tick):
            late = sorted(s for s, deadline in self.dead.items() if deadline <= event.now)
            return [BreakTree(tuple(late))] if late and not self.closed else []
        if isinstance(event, Closed):
            self.closed = True
            return []
        raise TypeError(f"not a repair event: {event!r}")

    def next_deadline(self) -> float | None:
        """When a dead node nobody asked for breaks the tree (a :class:`Tick`
        then is due)."""
        return min(self.dead.values(), default=None)

    def is_current(self, slot: int, generation: int) -> bool:
        """Call ``generation`` is the one running node ``slot`` now."""
        return self.generation.get(slot, 0) == generation

    # --------------------------------------------------------------- the steps

    def _refusal(self, slot: int) -> str | None:
        """Why node ``slot`` may not be repaired now (None: it may)."""
        if self.closed:
            return f"reduction {self.spec.rid} is no longer running"
        if not 0 <= slot < len(self.spec.inputs):
            return f"reduction {self.spec.rid} has no node {slot}"
        if slot == self.spec.root:
            return "the root of a reduce tree is not replaced (its task is rerun)"
        if slot in self.spread_slots:
            return f"node {slot} of reduction {self.spec.rid} was spread already"
        n = self.used_by_slot.get(slot, 0)
        if n >= self.budget:
            return f"node {slot} of reduction {self.spec.rid} was repaired {n} times already"
        return None

    def _node_lost(self, e: NodeLost) -> list[Decision]:
        if self.closed or not self.is_current(e.slot, e.generation) or e.slot in self.spread_slots:
            return []  # the result is complete, or the node was replaced or spread already
        if e.unreachable and self._refusal(e.slot) is None:
            if e.slot not in self.requests:
                self.dead.setdefault(e.slot, e.now + self.grace)
            return []
        return [BreakTree((e.slot,))]

    def _asked(self, e: RepairAsked) -> list[Decision]:
        if e.slot in self.requests:
            why: str | None = (
                f"node {e.slot} of reduction {self.spec.rid} is being repaired already"
            )
        else:
            why = self._refusal(e.slot)
        if why is not None:
            return [Refuse(e.slot, why)]
        self.requests[e.slot] = _Request(e.offset, e.dead)
        self.dead.pop(e.slot, None)  # its parent asked in time
        return [CheckNode(e.slot, e.dead)]

    def _checked(self, e: NodeChecked) -> list[Decision]:
        req = self.requests[e.slot]
        why = e.failure or self._refusal(e.slot)  # the tree may have ended meanwhile
        if why is not None:
            return [self._refuse(e.slot, why)]
        self.used += 1
        self.used_by_slot[e.slot] = self.used_by_slot.get(e.slot, 0) + 1
        self.dead_workers.add(req.dead)
        return [FindHolder(e.slot, self.spec.inputs[e.slot], avoid=req.dead)]

    def _holder_found(self, e: HolderFound) -> list[Decision]:
        if self.closed:
            return [self._refuse(e.slot, f"reduction {self.spec.rid} is no longer running")]
        req = self.requests[e.slot]
        if self.mode == "spread":
            plan = self._spread_plan(e.slot, req.offset, e.holder, e.load)
            if plan is not None:
                req.spread = Spread(e.slot, plan, e.holder)
                return [req.spread]
            if self.live.gone:
                # Spreads changed the children of some nodes: a node started
                # from the planned shape would read the wrong ones.
                return [self._refuse(e.slot, f"node {e.slot} could not be spread")]
        del self.requests[e.slot]
        addresses = list(self.spec.addresses)
        addresses[e.slot] = e.holder
        self.spec = dataclasses.replace(self.spec, addresses=tuple(addresses))
        generation = self.generation[e.slot] = self.generation.get(e.slot, 0) + 1
        return [Replace(e.slot, e.holder, req.offset, generation, self.spec)]

    def _spread_plan(
        self, slot: int, offset: int, holder: str, load: Mapping[str, int]
    ) -> SpreadPlan | None:
        hosts, live = self.spec.addresses, self.live
        mine = [u for u, h in enumerate(hosts) if h == holder and u != slot and u not in live.gone]
        if not mine:
            return None  # the input's new worker runs no node of this tree
        # Only inner nodes combine streams; a leaf would hand a child back.
        inner = {u: load.get(hosts[u], 0) for u in live.inner()}
        down = {u for u, h in enumerate(hosts) if h in self.dead_workers}
        try:
            return live.plan_spread(slot, offset, mine[0], inner, down)
        except SpreadRefused:
            return None

    def _spread_answered(self, e: SpreadAnswered) -> list[Decision]:
        req = self.requests.pop(e.slot)
        assert req.spread is not None
        plan = req.spread.plan
        patches = plan.patches(e.merged_from, e.adopted_from)
        self.live.apply(plan)
        self.spread_slots.add(e.slot)
        return [Patches(e.slot, plan, req.spread.holder, e.merged_from, tuple(patches))]

    def _refuse(self, slot: int, reason: str) -> Refuse:
        """End the repair of ``slot`` under way with a refusal."""
        self.requests.pop(slot, None)
        return Refuse(slot, reason)


def repair_load(trees: list[TreeRepair]) -> collections.Counter[str]:
    """Streams into each worker over the trees ``trees`` (every running tree
    of one reduction: a reduce in parts runs one per segment)."""
    return worker_load((t.live, t.spec.addresses) for t in trees)
