"""Repair of a running reduce tree whose node died: the bookkeeping, sans-IO.

When a node's worker dies, the node's parent asks the root for a replacement
(``hoplite_reduce_replace``) and the root starts a node for the same input on
a worker that holds it (Dask recomputes a lost input from its lineage). The
replacement starts at the byte the parent reached; the dead node's children
serve it from their partial results, which they still hold, and every other
node streams on. Only the path from the dead node to the root carries the
rest of the object again; a restart of the whole tree would carry all of it
through every node.

:class:`TreeRepair` is the root's state for one tree: which worker runs each
node now, which nodes failed and wait for their parent's request, and how many
replacements the tree may still take. The root's worker
(:mod:`dask_hoplite.worker`) drives it and does the IO.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from dask_hoplite.core.reduce_spec import ReduceSpec


@dataclass
class TreeRepair:
    """The root's repair state for reduce tree ``spec``.

    ``budget``: replacements each node of the tree may take
    (``hoplite.resume-attempts``). Per node, not per tree: a large tree
    meets failures of distinct workers as a matter of course (1% of 1,024),
    while a node that keeps dying where it is replaced (an input that kills
    its worker) must not loop for ever.
    ``grace``: how long a node that died may wait for its parent's request
    before the tree counts as broken (the parent notices a dead child when its
    stream breaks: at once for a killed process, after a stall timeout for a
    hung one).
    """

    spec: ReduceSpec
    budget: int
    grace: float
    used: int = 0  # replacements begun, in all
    #: Replacements begun, per slot.
    used_by_slot: dict[int, int] = field(default_factory=dict)
    #: The root stopped (result complete, or the tree failed): no more repairs.
    closed: bool = False
    #: Slots whose node died, with the time by which a repair must begin.
    dead: dict[int, float] = field(default_factory=dict)
    #: Slots being replaced right now (their input may be being recomputed).
    repairing: set[int] = field(default_factory=set)

    def refusal(self, slot: int) -> str | None:
        """Why node ``slot`` may not be replaced now (None: it may)."""
        if self.closed:
            return f"reduction {self.spec.rid} is no longer running"
        if not 0 <= slot < len(self.spec.inputs):
            return f"reduction {self.spec.rid} has no node {slot}"
        if slot == self.spec.root:
            return "the root of a reduce tree is not replaced (its task is rerun)"
        n = self.used_by_slot.get(slot, 0)
        if n >= self.budget:
            return f"node {slot} of reduction {self.spec.rid} was replaced {n} times already"
        return None

    def node_died(self, slot: int, now: float) -> None:
        """Node ``slot``'s worker did not answer: wait for its parent's request."""
        if slot not in self.repairing:
            self.dead.setdefault(slot, now + self.grace)

    def begin(self, slot: int) -> None:
        """A parent asked for node ``slot``'s replacement (not refused)."""
        self.repairing.add(slot)
        self.dead.pop(slot, None)
        self.used += 1
        self.used_by_slot[slot] = self.used_by_slot.get(slot, 0) + 1

    def abandon(self, slot: int) -> None:
        """Node ``slot`` could not be replaced (the tree breaks)."""
        self.repairing.discard(slot)

    def spread(self, slot: int) -> None:
        """Node ``slot`` was spread (:mod:`dask_hoplite.core.tree_spread`):
        nothing runs in its place."""
        self.repairing.discard(slot)

    def replaced(self, slot: int, address: str) -> ReduceSpec:
        """Node ``slot`` now runs on ``address``; returns the tree's spec."""
        addresses = list(self.spec.addresses)
        addresses[slot] = address
        self.spec = dataclasses.replace(self.spec, addresses=tuple(addresses))
        self.repairing.discard(slot)
        return self.spec

    def next_deadline(self) -> float | None:
        return min(self.dead.values(), default=None)

    def unrepaired(self, now: float) -> list[int]:
        """Dead nodes whose parent did not ask for a replacement in time."""
        return sorted(s for s, deadline in self.dead.items() if deadline <= now)
