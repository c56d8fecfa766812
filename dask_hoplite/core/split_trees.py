"""Split-tree broadcast planning: an object in ``k`` parts, each part down its
own tree, every host sending at most ``k`` streams of a part in all.

A pipelined chain (Hoplite's broadcast with fan-out 1) uses every uplink once
but grows one hop per receiver: at N receivers the last one waits N pipeline
fills (one block plus a wake-up each), which at a thousand workers costs more
than the transfer itself. A tree of fan-out ``k`` has depth ``log_k N`` but an
inner node sends ``k`` copies, so it runs at ``B/k``. Splitting the object in
``k`` parts and sending part ``j`` down a ``k``-ary tree whose inner nodes are
about one host in ``k`` (SplitStream, Castro et al. 2003; NCCL's double binary
tree for ``k = 2``) keeps both: an inner node sends ``k`` copies of ``S/k``
bytes, that is ``S`` once, a leaf sends nothing of that part, the source sends
each part once, and the depth is about ``log_k N``. A host whose ``k`` slots
straddle two trees is an inner node of both, with fewer children in each.

Pure functions, no I/O. The plans are handed to
:meth:`~dask_hoplite.core.directory.ObjectDirectory.plan_split`, which follows
them while the planned senders are alive and falls back to its own rules for a
receiver whose planned sender died.

Planning is per host, as the directory's: the trees span one worker per host
(the first of that host in ``receivers``); the other workers of a host take
every part from it over loopback, so each part enters each host once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dask.typing import Key

from dask_hoplite.core.hosts import host_of


@dataclass(frozen=True)
class SplitPart:
    """Part ``part`` of the split-tree broadcast of ``keys`` to ``receivers``;
    the directory plans its tree at the key's first request, from its holder
    then."""

    part: int
    keys: tuple[Key, ...]
    receivers: tuple[str, ...]


def split_tree_parents(source: str, receivers: Sequence[str], parts: int) -> list[dict[str, str]]:
    """For each part ``j`` in ``range(parts)``, the sender of every receiver.

    ``source`` holds all parts; ``receivers`` (distinct, ``source`` among them
    or not) need all of them. Each host may send ``parts`` streams of one
    part (``S`` in all); part ``j``'s inner nodes are the next hosts in line
    with streams to spare, nearly all with ``parts`` children, so its depth
    is about ``log_parts(hosts)``; the source sends each part once.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if len(set(receivers)) != len(receivers):
        raise ValueError("receivers must be distinct")
    src_host = host_of(source)
    heads: dict[str, str] = {}  # host -> the worker the trees reach
    local: list[tuple[str, str]] = []  # (worker, its host's head)
    for r in receivers:
        if r == source:
            continue
        h = host_of(r)
        if h == src_host:
            local.append((r, source))
        elif h in heads:
            local.append((r, heads[h]))
        else:
            heads[h] = r
    hosts = list(heads.values())
    m, k = len(hosts), parts
    plans: list[dict[str, str]] = []
    for j in range(k):
        # Host i owns upload slots [i*k, (i+1)*k) (streams of one part, S/k
        # each); part j's tree uses slots [j*(m-1), (j+1)*(m-1)): its inner
        # nodes are the hosts owning them, each with as many children as it
        # has slots there, so no host uses more than its k slots in all.
        lo, hi = j * (m - 1), (j + 1) * (m - 1)
        counts: dict[str, int] = {}
        for i in range(lo // k, -(-hi // k)):
            n = min(hi, (i + 1) * k) - max(lo, i * k)
            if n > 0:
                counts[hosts[i]] = n
        inner = sorted(counts, key=lambda h: -counts[h])  # the widest on top
        order = inner + [h for h in hosts if h not in counts]
        parent: dict[str, str] = {order[0]: source} if order else {}
        nxt = 1
        for h in inner:
            for child in order[nxt : nxt + counts[h]]:
                parent[child] = h
            nxt += counts[h]
        parent.update(local)
        plans.append(parent)
    return plans


def tree_depth(parents: dict[str, str], source: str) -> int:
    """Hops from ``source`` to the deepest receiver of one part's plan."""
    depth: dict[str, int] = {source: 0}

    def walk(r: str) -> int:
        path = []
        while r not in depth:
            path.append(r)
            r = parents[r]
            if len(path) > len(parents):
                raise ValueError("the plan has a cycle")
        d = depth[r]
        for node in reversed(path):
            d += 1
            depth[node] = d
        return d

    return max((walk(r) for r in parents), default=0)
