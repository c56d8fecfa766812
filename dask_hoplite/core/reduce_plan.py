"""How one reduction will run, decided once its inputs are ready. Pure: no
I/O, no event loop.

:func:`plan_reduction` turns what the scheduler says about the chosen inputs
(who holds them, how big they are, how fast the network is) into a plan, a
msgpack-able dict with ``mode``:

- ``"tree"``: a pipelined reduce tree (``spec``, a :class:`ReduceSpec`
  message) rooted on ``root``, the worker holding the root's input;
- ``"values"``: one task on ``root`` fetches the inputs and reduces them, as
  Dask alone would (small objects, or dask-hoplite not registered: ``net``
  is None).

``chosen`` lists the input keys the result contains and ``spares`` the ones
that were not chosen (``k < n``), which a tree may take instead of a chosen
input that is lost while it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dask.typing import Key

from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.planner import colocated_order, max_chain_length, plan_reduce_tree
from dask_hoplite.core.reduce_spec import ReduceSpec, segment_rid
from dask_hoplite.core.split_trees import split_tree_parents


def tree_spec(
    rid: str,
    op: str,
    keys: Sequence[Key],
    addresses: Sequence[str],
    net: NetworkEstimate,
    size: int,
    block_bytes: int,
    to: str | None = None,
) -> ReduceSpec:
    """One reduce tree over ``keys`` (held by ``addresses``) shaped by the
    network estimate, with the inputs of one worker next to each other (their
    combination then crosses no NIC); the input at the root's position stays
    there. With ``to``, the root is on worker ``to``: with an input ``to``
    holds when there is one, else with the first input (which ``to`` then
    fetches before the tree starts)."""
    plan = plan_reduce_tree(len(keys), max_chain_length(size, net.bandwidth, net.latency))
    root_input = addresses.index(to) if to in addresses else plan.root
    order = colocated_order(plan.parent, list(addresses), root_input)
    ordered = [addresses[i] for i in order]
    if to is not None:
        ordered[plan.root] = to
    return ReduceSpec(
        rid=rid,
        op=op,
        inputs=tuple(keys[i] for i in order),
        addresses=tuple(ordered),
        parent=plan.parent,
        shape=(),
        dtype="",
        block_bytes=block_bytes,
    )


def split_tree_specs(
    rid: str,
    op: str,
    keys: Sequence[Key],
    addresses: Sequence[str],
    root_input: int,
    parts: int,
    block_bytes: int,
) -> list[ReduceSpec]:
    """One reduce tree per segment ``j`` of ``parts`` of the inputs, all
    rooted at input ``root_input``: the split-tree broadcast's trees
    (:func:`~dask_hoplite.core.split_trees.split_tree_parents`) run upwards.
    Every host then receives ``parts`` segment streams at most (the object
    once) and sends one per segment, and the depth is about
    ``log_parts(hosts)``. The inputs of one worker combine there first."""
    root = addresses[root_input]
    first: dict[str, int] = {}  # each worker's first input (its node in the trees)
    for slot, a in enumerate(addresses):
        first.setdefault(a, root_input if a == root else slot)
    workers = [a for a in first if a != root]
    specs = []
    for j, plan in enumerate(split_tree_parents(root, workers, parts)):
        parent: list[int | None] = []
        for slot, a in enumerate(addresses):
            if slot == root_input:
                parent.append(None)
            elif first[a] != slot:
                parent.append(first[a])  # combined on its own worker first
            else:
                parent.append(first[plan[a]])
        specs.append(
            ReduceSpec(
                rid=segment_rid(rid, j),
                op=op,
                inputs=tuple(keys),
                addresses=tuple(addresses),
                parent=tuple(parent),
                shape=(),
                dtype="",
                block_bytes=block_bytes,
                segment=(j, parts),
            )
        )
    return specs


def plan_reduction(
    rid: str,
    op: str,
    chosen: Sequence[Key],
    spares: Sequence[Key],
    who_has: Mapping[Key, Sequence[str]],
    nbytes: Mapping[Key, int],
    net: NetworkEstimate | None,
    min_bytes: int,
    block_bytes: int,
    to: str | None = None,
    parts: int = 1,
) -> dict[str, Any]:
    """The plan for reducing ``chosen`` (every one held somewhere: ``who_has``
    lists a holder for each), with the result on worker ``to`` if given; in
    ``parts`` segments, each up its own tree (:func:`split_tree_specs`), when
    ``parts`` is above 1 and the inputs are on three workers or more."""
    addresses = []
    for key in chosen:
        holders = sorted(who_has.get(key) or ())
        if not holders:
            raise ValueError(f"input {key!r} has no holder to plan with")
        addresses.append(to if to in holders else holders[0])
    size = max(int(nbytes.get(key, 0) or 0) for key in chosen)
    plan: dict[str, Any] = {"chosen": list(chosen), "spares": list(spares), "op": op}
    if net is None or size < min_bytes:
        return {**plan, "mode": "values", "root": to or addresses[0]}
    if parts > 1 and len(set(addresses)) >= 3:
        root_input = addresses.index(to) if to in addresses else 0
        if to is not None and to not in addresses:
            addresses[root_input] = to  # ``to`` fetches that input first
        specs = split_tree_specs(rid, op, chosen, addresses, root_input, parts, block_bytes)
        return {
            **plan,
            "mode": "split",
            "specs": [s.to_msg() for s in specs],
            "root": addresses[root_input],
        }
    spec = tree_spec(rid, op, chosen, addresses, net, size, block_bytes, to)
    return {**plan, "mode": "tree", "spec": spec.to_msg(), "root": spec.addresses[spec.root]}


@dataclass(frozen=True)
class PlanRequest:
    """What a reduction's planning task is given: its inputs (keys, which Dask
    must not take for dependencies: this object is passed as it is), how many
    of them to reduce, the op, the key of its result task, and the client's
    ``hoplite.min-bytes`` and ``hoplite.block-bytes`` at the call; ``to``:
    the worker the result must be on (None: the planner picks the root)."""

    rid: str
    op: str
    inputs: tuple[Key, ...]
    k: int
    result: Key
    min_bytes: int
    block_bytes: int
    to: str | None = None
    #: Above 1: reduce that many segments, each up its own tree.
    parts: int = 1

    @property
    def plan_key(self) -> str:
        """The key of the planning task."""
        return f"hoplite-plan-{self.op}-{self.rid}"
