"""How many parts: one tree or split trees, chosen from the number of hosts,
the object's size and the network. Pure: no I/O.

A broadcast or reduce of ``S`` bytes over ``m`` hosts at per-host bandwidth
``B`` cannot beat ``S/B``. What each shape adds on top, as modelled here:

* **one tree** (``parts = 1``). A broadcast is a pipelined chain through every
  receiving host; a relay forwards a block once all of it has landed, so the
  last host is ``m`` pipeline fills behind the source, one block plus the
  per-hop latency ``L`` each: ``S/B + m (b/B + L)``. A reduce is Hoplite's
  tree (:func:`~dask_hoplite.core.tree_shape.plan_reduce_tree`): chains below a
  binary top whose nodes take two streams in, so their ingress carries
  ``2 S``: ``f S/B + h (b/B + L)`` with ``f`` the widest fan-in and ``h`` the
  height.
* **split trees** (``parts = k``, :mod:`~dask_hoplite.core.split_trees`).
  Part ``j`` of ``S/k`` bytes goes down its own tree of depth ``d`` about
  ``log_k m``; every host still moves ``S`` once each way, so the pipeline
  fill per hop is a block at ``B/k``: ``S/B + d (k b/B + L)``. Nothing is
  joined: a broadcast's receivers fill one buffer range by range
  (:mod:`~dask_hoplite.core.byte_ranges`), a reduce makes each segment in its
  place in the result.

:func:`choose_parts` takes the shape of least predicted time among
:data:`PART_CHOICES` with parts of at least :data:`MIN_BLOCKS` full blocks (a
smaller part is mostly pipeline fill), and leaves one tree only when split
trees are predicted at least :data:`MARGIN` faster (the model leaves out the
setup of each stream, which weighs most where the two are close). So one
chain or tree at 8 or 16 hosts (a few pipeline fills) and split trees at a
thousand (a thousand fills cost more than the transfer). The reduce planner
(:mod:`~dask_hoplite.core.reduce_plan`), the directory's split of a key into
byte ranges (the scheduler part's ``DirectoryService``) and the simulator
(``benchmarks/simulate.py``) all choose with it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from dask_hoplite.core.split_trees import split_tree_parents, tree_depth
from dask_hoplite.core.tree_shape import max_chain_length, plan_reduce_tree

#: The part counts considered.
PART_CHOICES = (1, 2, 4, 8, 16, 32)
#: The share of one tree's predicted time split trees must save to be chosen.
MARGIN = 0.1
#: Blocks of a stream (``hoplite.min-block-bytes``, ``hoplite.min-blocks``):
#: an object is cut into at least this many blocks, none smaller than this.
MIN_BLOCK_BYTES = 32 * 2**10
MIN_BLOCKS = 16

Collective = Literal["broadcast", "reduce"]


@dataclass(frozen=True)
class ShapeCost:
    """The predicted time of one shape: ``parts`` (1: one tree), its depth
    in hops, and seconds from start to the last byte."""

    parts: int
    depth: int
    seconds: float


def block_bytes_for(nbytes: float, block_bytes: int) -> float:
    """The block of a stream of ``nbytes`` (``hoplite.block-bytes`` at most)."""
    return max(MIN_BLOCK_BYTES, min(block_bytes, nbytes / MIN_BLOCKS))


@functools.lru_cache(maxsize=256)
def split_depth(hosts: int, parts: int) -> int:
    """Hops from the source to the deepest of ``hosts - 1`` receiving hosts
    in the split trees of ``parts`` parts (the deepest part's tree)."""
    names = [f"tcp://h{i}:1" for i in range(hosts)]
    plans = split_tree_parents(names[0], names[1:], parts)
    return max((tree_depth(p, names[0]) for p in plans), default=0)


def shape_costs(
    collective: Collective,
    hosts: int,
    nbytes: int,
    bandwidth: float,
    latency: float,
    block_bytes: int,
) -> list[ShapeCost]:
    """The predicted cost of every shape :func:`choose_parts` considers, one
    tree first (``hosts``: the hosts taking part, the source or root among
    them; ``bandwidth`` in bytes per second per host, ``latency`` in seconds
    per hop, as :class:`~dask_hoplite.core.network_model.NetworkEstimate`)."""
    if collective not in ("broadcast", "reduce"):
        raise ValueError(f"collective must be 'broadcast' or 'reduce', got {collective!r}")
    if hosts < 1 or nbytes < 0 or bandwidth <= 0 or latency <= 0:
        raise ValueError(
            "need hosts >= 1, nbytes >= 0, bandwidth > 0 and latency > 0 "
            f"(got {hosts}, {nbytes}, {bandwidth}, {latency})"
        )
    wire = nbytes / bandwidth
    block = block_bytes_for(nbytes, block_bytes)
    fill = block / bandwidth + latency
    if collective == "broadcast":
        one = ShapeCost(1, hosts - 1, wire + (hosts - 1) * fill)
    else:
        tree = plan_reduce_tree(hosts, max_chain_length(nbytes, bandwidth, latency))
        fan_in = max((len(tree.children(v)) for v in range(tree.n)), default=0)
        height = tree.height()
        one = ShapeCost(1, height, max(fan_in, 1) * wire + height * fill)
    costs = [one]
    if hosts < 3:  # a split needs two receivers besides the source
        return costs
    for k in PART_CHOICES[1:]:
        if k >= hosts or nbytes / k < MIN_BLOCKS * block_bytes:
            break  # more parts than receivers, or parts too small to pipeline
        depth = split_depth(hosts, k)
        part_fill = k * block_bytes_for(nbytes / k, block_bytes) / bandwidth + latency
        costs.append(ShapeCost(k, depth, wire + depth * part_fill))
    return costs


def choose_parts(
    collective: Collective,
    hosts: int,
    nbytes: int,
    bandwidth: float,
    latency: float,
    block_bytes: int,
) -> int:
    """How many parts to broadcast or reduce ``nbytes`` over ``hosts`` in
    (1: one tree): the split trees of least predicted time if they save at
    least :data:`MARGIN` of one tree's, else one tree."""
    one, *split = shape_costs(collective, hosts, nbytes, bandwidth, latency, block_bytes)
    if not split:
        return 1
    best = min(split, key=lambda c: (c.seconds, c.parts))
    if best.seconds <= (1 - MARGIN) * one.seconds and math.isfinite(best.seconds):
        return best.parts
    return 1
