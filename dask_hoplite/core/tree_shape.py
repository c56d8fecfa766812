"""A reduce tree's shape, as in Hoplite: how deep, how many chains, which slot each input fills.

Pure functions, no I/O. A reduction of N objects of S bytes runs on N nodes
(the result's receiver is one of them, the root); every node adds the streams of
its children to its own operand block by block and streams the partial result
to its parent. The shape trades depth against fan-in:

* a *chain* has one child per node: each node's NIC carries S in and S out, so
  the whole reduction takes about S/B plus one block's latency per hop, which is
  best when S/B dwarfs the per-hop latency L;
* a *binary tree* has depth log2(N) but a node takes two streams in, so its
  ingress is shared: best for small objects, where latency dominates.

Hoplite's rule (Zhuang et al., 2021, and its reference code): with
``k = round(S / (B * L))`` the longest chain worth having, the tree depth is
``d = min(ceil(log2((N + 1) / (k + 1))), floor(log2(N + 1)))``; ``d <= 0`` gives
one chain of N nodes, otherwise a full binary tree of ``2**d - 1`` nodes whose
bottom level carries ``2**d`` chains (two per node) sharing the remaining nodes
evenly. Nodes are numbered in the order inputs should fill them: an in-order
walk, so the inputs that were ready first take the slots farthest from the root.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from dask_hoplite.core.hosts import host_of


def max_chain_length(nbytes: int, bandwidth: float, latency: float) -> int:
    """Hoplite's ``k``: how many hops a chain may have before the per-hop
    latency costs more than a tree's shared ingress (``round(S / (B * L))``).

    ``bandwidth`` in bytes per second, ``latency`` in seconds per hop.
    """
    if nbytes < 0 or bandwidth <= 0 or latency <= 0:
        raise ValueError(
            f"need nbytes >= 0, bandwidth > 0 and latency > 0 "
            f"(got {nbytes}, {bandwidth}, {latency})"
        )
    return int(round(nbytes / (bandwidth * latency)))


@dataclass(frozen=True)
class ReduceTree:
    """A reduction's shape over nodes ``0 .. n-1`` (numbered in fill order)."""

    parent: tuple[int | None, ...]
    depth: int  # binary levels above the chains (0: a single chain)
    chain_length: int  # the k it was planned with
    _children: tuple[tuple[int, ...], ...] = field(repr=False, compare=False, default=())

    @classmethod
    def of(cls, parent: Sequence[int | None], depth: int = 0, chain_length: int = 0) -> ReduceTree:
        """The tree of these parent links, each node's children in node order."""
        children: list[list[int]] = [[] for _ in parent]
        for v, p in enumerate(parent):
            if p is not None:
                children[p].append(v)
        return cls(tuple(parent), depth, chain_length, tuple(tuple(c) for c in children))

    @property
    def n(self) -> int:
        return len(self.parent)

    @property
    def root(self) -> int:
        return self.parent.index(None)

    def children(self, node: int) -> tuple[int, ...]:
        return self._children[node]

    def path_to_root(self, node: int) -> list[int]:
        """``node``'s ancestors, nearest first (the nodes that restart when a
        stream below them fails)."""
        out = []
        p = self.parent[node]
        while p is not None:
            out.append(p)
            p = self.parent[p]
        return out

    def height(self) -> int:
        """Longest path from a node to the root, in hops."""
        return max((len(self.path_to_root(i)) for i in range(self.n)), default=0)


class _Node:
    __slots__ = ("left", "right")

    def __init__(self) -> None:
        self.left: _Node | None = None
        self.right: _Node | None = None


def plan_reduce_tree(n: int, chain_length: int) -> ReduceTree:
    """The shape for ``n`` nodes given the longest worthwhile chain ``chain_length``."""
    if n < 1:
        raise ValueError(f"a reduction needs at least one node, got {n}")
    if chain_length < 0:
        raise ValueError(f"chain_length must be >= 0, got {chain_length}")
    k = chain_length
    depth = min(
        math.ceil(math.log2((n + 1) / (k + 1))),
        math.floor(math.log2(n + 1)),
    )
    depth = max(depth, 0)

    def chain(length: int) -> _Node | None:
        """A chain of ``length`` nodes; returns its top (children hang left)."""
        top = None
        for _ in range(length):
            node = _Node()
            node.left = top
            top = node
        return top

    if depth == 0:
        root = chain(n)
        assert root is not None
    else:
        tree = [_Node() for _ in range(2**depth - 1)]
        for i in range(2 ** (depth - 1) - 1):  # inner nodes, heap layout
            tree[i].left, tree[i].right = tree[2 * i + 1], tree[2 * i + 2]
        rest = n - len(tree)
        n_chains = 2**depth
        lengths = [rest // n_chains + (1 if i < rest % n_chains else 0) for i in range(n_chains)]
        bottom = tree[2 ** (depth - 1) - 1 :]
        for j, node in enumerate(bottom):
            node.left = chain(lengths[2 * j])
            node.right = chain(lengths[2 * j + 1])
        root = tree[0]

    # Number the nodes by an in-order walk (iterative: chains may be long).
    order: dict[int, int] = {}
    parent_of: dict[int, _Node | None] = {id(root): None}
    nodes: list[_Node] = []
    stack: list[_Node] = []
    cur: _Node | None = root
    while stack or cur is not None:
        while cur is not None:
            stack.append(cur)
            if cur.left is not None:
                parent_of[id(cur.left)] = cur
            cur = cur.left
        cur = stack.pop()
        order[id(cur)] = len(nodes)
        nodes.append(cur)
        if cur.right is not None:
            parent_of[id(cur.right)] = cur
        cur = cur.right
    assert len(nodes) == n, (len(nodes), n)
    parent = [None if (p := parent_of[id(node)]) is None else order[id(p)] for node in nodes]
    return ReduceTree.of(parent, depth, k)


def colocated_order(
    parent: Sequence[int | None], addresses: Sequence[str], root_input: int
) -> list[int]:
    """Which input goes to which node of a tree: ``order[node]`` is the
    input index, input ``root_input`` at the root.

    Inputs held by one worker are put on nodes that are parent and child
    wherever the tree's shape allows, so that their combination crosses no
    NIC: without this, a worker holding two inputs (several inputs per
    worker, or a lost input recomputed next to another) sends both, 2 S
    through one NIC, and bounds the whole reduce at 2 S/B.

    Workers of one host are kept together the same way, after the inputs of
    one worker: an edge between two workers of a host crosses loopback, not
    the NIC.

    Greedy, top-down: a child takes an input of its parent's worker while
    one is left, else one of another worker of the parent's host, else one
    of the worker with the most inputs left (whose
    others can then follow into its own children); tried with the children
    of each node taken largest subtree first and smallest first, and kept
    only if it crosses fewer NICs (then fewer workers) than the inputs in
    their given order."""
    n = len(parent)
    if len(addresses) != n or not 0 <= root_input < n:
        raise ValueError(f"{n} nodes, {len(addresses)} inputs, root input {root_input}")
    children: list[list[int]] = [[] for _ in range(n)]
    root = -1
    for node, p in enumerate(parent):
        if p is None:
            root = node
        else:
            children[p].append(node)
    top_down = [root]
    for node in top_down:  # breadth-first; the list grows while iterated
        top_down.extend(children[node])
    size = [1] * n  # of each node's subtree, children before their parents
    for node in reversed(top_down):
        p = parent[node]
        if p is not None:
            size[p] += size[node]
    given = list(range(n))
    given[root], given[root_input] = given[root_input], given[root]
    candidates = [given]
    for largest_first in (True, False):
        kids = [sorted(c, key=lambda v: -size[v] if largest_first else size[v]) for c in children]
        candidates.append(_fill(kids, root, root_input, addresses))
    return min(candidates, key=lambda order: _crossings(parent, addresses, order))


def _fill(
    children: list[list[int]], root: int, root_input: int, addresses: Sequence[str]
) -> list[int]:
    left: dict[str, list[int]] = {}
    for i, a in enumerate(addresses):
        if i != root_input:
            left.setdefault(a, []).append(i)
    hosts = {a: host_of(a) for a in set(addresses)}
    # The worker to take an input from when the parent's worker has none
    # left: another worker of the parent's host, else any; of those, the one
    # with the most inputs left, then the one whose next input comes first.
    # Heaps of (-inputs left, next input, worker), one per host and one for
    # all; an entry whose worker has changed since is skipped when met.
    everyone: list[tuple[int, int, str]] = []
    by_host: dict[str, list[tuple[int, int, str]]] = {}

    def push(a: str) -> None:
        entry = (-len(left[a]), left[a][0], a)
        heapq.heappush(everyone, entry)
        heapq.heappush(by_host.setdefault(hosts[a], []), entry)

    def best(heap: list[tuple[int, int, str]]) -> str | None:
        while heap:
            n, first, a = heap[0]
            inputs = left.get(a)
            if inputs and len(inputs) == -n and inputs[0] == first:
                return a
            heapq.heappop(heap)
        return None

    for a in left:
        push(a)
    order = [-1] * len(addresses)
    order[root] = root_input
    queue = [root]
    for node in queue:  # breadth-first; the queue grows while iterated
        for c in children[node]:
            addr = addresses[order[node]]
            if addr not in left:
                found = best(by_host.get(hosts[addr], [])) or best(everyone)
                assert found is not None, "more nodes than inputs"
                addr = found
            inputs = left[addr]
            order[c] = inputs.pop(0)
            if inputs:
                push(addr)
            else:
                del left[addr]
            queue.append(c)
    return order


def _crossings(
    parent: Sequence[int | None], addresses: Sequence[str], order: list[int]
) -> tuple[int, int]:
    """Tree edges whose two inputs live on different hosts (they cross NICs),
    and on different workers (they cross at least a process boundary)."""
    edges = [
        (addresses[order[c]], addresses[order[p]]) for c, p in enumerate(parent) if p is not None
    ]
    return (
        sum(1 for a, b in edges if host_of(a) != host_of(b)),
        sum(1 for a, b in edges if a != b),
    )
