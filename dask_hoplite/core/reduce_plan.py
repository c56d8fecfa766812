"""Every reduction's plan, from one planner. Pure: no I/O, no event loop.

:func:`plan_reduction` turns what a caller asked for (a :class:`PlanRequest`)
and what the cluster says about the chosen inputs (who holds them, how big
they are, how fast the network is) into a :class:`Plan`, one of:

- :class:`OneTask`: one task on ``worker`` fetches the inputs and reduces
  them, as Dask alone would: objects under ``hoplite.min-bytes`` (the
  small-object rule, :func:`is_small`, decided here only), or a cluster
  without dask-hoplite (:func:`plan_without_hoplite`);
- :class:`Tree`: one pipelined reduce tree (a :class:`ReduceSpec`) rooted on
  the worker holding the root's input; inputs that are dicts of arrays are
  reduced leaf by leaf (``leaves``), one tree per leaf;
- :class:`SplitTrees`: a reduce in parts, each segment of the inputs up its
  own tree, all rooted on one worker, which joins them; how many parts, by
  default, :func:`~dask_hoplite.core.shape_choice.choose_parts` decides from
  the inputs' workers, their size and the network;
- :class:`AllreduceTree`: a reduce tree whose result streams down a chain
  of copies while it is produced (an allreduce whose inputs are all on one
  worker has nothing to copy: a :class:`Tree`);
- :class:`SegmentedAllreduce`: an allreduce as one reduce-then-broadcast
  pipeline per segment, each rooted on another worker.

A tree that broke and restarts is placed again here too
(:func:`relocated_spec`): the same shape, every input where it is now.

One caller plans: the scheduler's reduction coordinator
(:mod:`dask_hoplite.scheduler.reduction_coordinator`), for
:func:`dask_hoplite.reduce`'s planning task, :func:`dask_hoplite.allreduce`,
the dask.array/bag aggregates taken over on a worker, an allreduce's
fallback to a plain tree and a broken tree's restart. On a cluster without
dask-hoplite a planning task takes :func:`plan_without_hoplite`. The worker
shells dispatch once, on the plan's type. A plan travels as a msgpack-able dict
(:meth:`~_PlanBase.to_msg`, :func:`plan_from_msg`).

Every plan lists the input keys the result contains (``chosen``) and the ones
that were not chosen (``spares``, with ``k < n``), which a tree may take
instead of a chosen input lost while it runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from dask.typing import Key

from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_spec import ReduceSpec, segment_rid
from dask_hoplite.core.shape_choice import choose_parts
from dask_hoplite.core.split_trees import split_tree_parents
from dask_hoplite.core.tree_shape import colocated_order, max_chain_length, plan_reduce_tree
from dask_hoplite.errors import ReduceInputLost

logger = logging.getLogger(__name__)


def is_small(size: int, min_bytes: int) -> bool:
    """Objects of ``size`` bytes are reduced in one task, as Dask would: a
    tree costs more round trips than it saves bytes (``hoplite.min-bytes``)."""
    return size < min_bytes


@dataclass(frozen=True)
class PlanRequest:
    """What a caller asks of the planner: the reduction's id and op, its
    inputs (keys; a planning task gets this object as it is, so Dask does not
    take them for dependencies), how many of them to reduce, and the caller's
    settings at the call.

    ``result``: the key of a reduction's result task (None where there is
    none). ``to``: the worker the result must be on (None: the planner picks
    the root). ``parts``: above 1, reduce that many segments, each up its own
    tree; None: as many as :func:`~dask_hoplite.core.shape_choice.choose_parts`
    picks for the chosen inputs' workers, size and network. ``allreduce``: the result is wanted on every worker holding an
    input. ``leaves``: the entries of dict inputs to reduce, each up its own
    tree (``(None,)``: the inputs are arrays). ``root_input``: the index of
    the chosen input whose value ``to`` has in hand (None: one ``to`` holds,
    if any); it is the root's operand, whoever else holds its key."""

    rid: str
    op: str
    inputs: tuple[Key, ...]
    k: int
    min_bytes: int
    block_bytes: int
    result: Key | None = None
    to: str | None = None
    parts: int | None = 1
    allreduce: bool = False
    segment_min_bytes: int = 0
    leaves: tuple[str | None, ...] = (None,)
    root_input: int | None = None

    @property
    def plan_key(self) -> str:
        """The key of a reduction's planning task."""
        return f"hoplite-plan-{self.op}-{self.rid}"

    def to_msg(self) -> dict[str, Any]:
        """The request as a msgpack-able dict (what the scheduler plans from)."""
        msg = dataclasses.asdict(self)
        msg["inputs"], msg["leaves"] = list(self.inputs), list(self.leaves)
        return msg

    @classmethod
    def from_msg(cls, m: Mapping[str, Any]) -> PlanRequest:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(m) - names
        if unknown:
            raise ValueError(f"a reduction request with unknown fields {sorted(unknown)}")
        fields = dict(m)
        fields["inputs"] = tuple(m["inputs"])
        fields["leaves"] = tuple(m.get("leaves") or (None,))
        return cls(**fields)


@dataclass(frozen=True)
class _PlanBase:
    """What every plan holds; subclasses add how it runs."""

    #: The ``type`` of the plan's message.
    TAG: ClassVar[str] = ""

    rid: str
    op: str
    chosen: tuple[Key, ...]
    spares: tuple[Key, ...]

    @property
    def root(self) -> str:
        """The worker the result is made on."""
        raise NotImplementedError

    def to_msg(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"type": self.TAG}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ReduceSpec):
                value = value.to_msg()
            elif isinstance(value, tuple):
                value = [v.to_msg() if isinstance(v, ReduceSpec) else v for v in value]
            msg[f.name] = value
        return msg

    @classmethod
    def _from_fields(cls, m: Mapping[str, Any]) -> Any:
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in m:
                raise ValueError(f"a {cls.TAG!r} plan message without {f.name!r}")
            value = m[f.name]
            if f.name == "spec":
                value = ReduceSpec.from_msg(value)
            elif f.name == "specs":
                value = tuple(ReduceSpec.from_msg(v) for v in value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclass(frozen=True)
class OneTask(_PlanBase):
    """One task on ``worker`` fetches the chosen inputs and reduces them (an
    allreduce's other outputs then pull the result from ``worker``:
    :func:`~dask_hoplite.core.allreduce_outputs.output_roles`)."""

    TAG: ClassVar[str] = "one-task"

    worker: str

    @property
    def root(self) -> str:
        return self.worker


@dataclass(frozen=True)
class Tree(_PlanBase):
    """One pipelined reduce tree; dict inputs are reduced leaf by leaf, one
    tree per entry of ``leaves`` (:meth:`leaf_specs`)."""

    TAG: ClassVar[str] = "tree"

    spec: ReduceSpec
    leaves: tuple[str | None, ...] = (None,)

    @property
    def root(self) -> str:
        return self.spec.addresses[self.spec.root]

    def leaf_specs(self) -> list[ReduceSpec]:
        """One spec per leaf: the tree, reducing that entry of every input."""
        if self.leaves == (None,):
            return [self.spec]
        return [
            dataclasses.replace(self.spec, rid=f"{self.spec.rid}-{j}", field=leaf)
            for j, leaf in enumerate(self.leaves)
        ]


@dataclass(frozen=True)
class SplitTrees(_PlanBase):
    """A reduce in parts: segment ``j`` of the inputs up tree ``specs[j]``,
    every tree rooted on one worker, which joins the segments."""

    TAG: ClassVar[str] = "split-trees"

    specs: tuple[ReduceSpec, ...]

    @property
    def root(self) -> str:
        first = self.specs[0]
        return first.addresses[first.root]


@dataclass(frozen=True)
class AllreduceTree(_PlanBase):
    """A reduce tree whose result streams down the chain of workers
    ``spec.copies`` while the tree produces it."""

    TAG: ClassVar[str] = "allreduce-tree"

    spec: ReduceSpec

    @property
    def root(self) -> str:
        return self.spec.addresses[self.spec.root]


@dataclass(frozen=True)
class SegmentedAllreduce(_PlanBase):
    """An allreduce in ``len(specs)`` segments: segment ``i`` is reduced up
    tree ``specs[i]``, rooted at input slot ``roots[i]`` on the i-th worker,
    and streams to the others (``specs[i].copies``) while it is produced.
    Every worker then joins the segments: its own and the others' copies."""

    TAG: ClassVar[str] = "segmented-allreduce"

    specs: tuple[ReduceSpec, ...]
    roots: tuple[int, ...]

    @property
    def root(self) -> str:
        return self.workers[0]

    @property
    def workers(self) -> list[str]:
        """The worker of each segment's root, in segment order."""
        return [s.addresses[r] for s, r in zip(self.specs, self.roots, strict=True)]


Plan = OneTask | Tree | SplitTrees | AllreduceTree | SegmentedAllreduce
_TYPES: dict[str, type[Any]] = {
    t.TAG: t for t in (OneTask, Tree, SplitTrees, AllreduceTree, SegmentedAllreduce)
}


def plan_from_msg(m: Mapping[str, Any]) -> Plan:
    """The plan a message of :meth:`~_PlanBase.to_msg` describes."""
    try:
        cls = _TYPES[m["type"]]
    except KeyError:
        raise ValueError(f"not a reduction plan: type {m.get('type')!r}") from None
    plan: Plan = cls._from_fields(m)
    return plan


def plan_reduction(
    req: PlanRequest,
    chosen: Sequence[Key],
    who_has: Mapping[Key, Sequence[str]],
    nbytes: Mapping[Key, int],
    net: NetworkEstimate,
) -> Plan:
    """The plan for reducing ``chosen`` (every one held somewhere: ``who_has``
    lists a holder for each; an input on ``req.to`` is taken from there), as
    ``req`` asks. Called by the scheduler's reduction coordinator only
    (:mod:`dask_hoplite.scheduler.reduction_coordinator`)."""
    addresses, base = _placed(req, chosen, who_has)
    plan = _plan(req, chosen, nbytes, net, addresses, base)
    logger.debug(
        "reduction %s planned: %s of %d inputs, root %s", req.rid, plan.TAG, len(chosen), plan.root
    )
    return plan


def unknown_to(to: str, workers: Collection[str]) -> str | None:
    """Why ``to``, the worker a result is asked on, is refused (None: it is
    one of ``workers``, the cluster's)."""
    if to in workers:
        return None
    return f"to={to!r} is not a worker of this cluster; workers: {sorted(workers)}"


def plan_without_hoplite(
    req: PlanRequest, chosen: Sequence[Key], who_has: Mapping[Key, Sequence[str]]
) -> OneTask:
    """The plan on a cluster without dask-hoplite: one task fetches the
    chosen inputs and reduces them, as Dask alone would."""
    addresses, base = _placed(req, chosen, who_has)
    return _one_task(req, base, addresses)


def _placed(
    req: PlanRequest, chosen: Sequence[Key], who_has: Mapping[Key, Sequence[str]]
) -> tuple[list[str], dict[str, Any]]:
    """The worker each chosen input is taken from, and the fields every plan has."""
    addresses = [input_worker(key, who_has, req.to) for key in chosen]
    if req.root_input is not None:
        assert req.to is not None, "root_input goes with to"
        addresses[req.root_input] = req.to
    spares = list(req.inputs)
    for key in chosen:
        if key in spares:
            spares.remove(key)
    base: dict[str, Any] = {
        "rid": req.rid,
        "op": req.op,
        "chosen": tuple(chosen),
        "spares": tuple(spares),
    }
    return addresses, base


def _one_task(req: PlanRequest, base: dict[str, Any], addresses: list[str]) -> OneTask:
    return OneTask(**base, worker=req.to or addresses[0])


def _plan(
    req: PlanRequest,
    chosen: Sequence[Key],
    nbytes: Mapping[Key, int],
    net: NetworkEstimate,
    addresses: list[str],
    base: dict[str, Any],
) -> Plan:
    """:func:`plan_reduction`, the chosen inputs placed (``addresses``) and the
    fields every plan has (``base``) known."""
    spares = base["spares"]
    size = max(int(nbytes.get(key, 0) or 0) for key in chosen)
    distinct = list(dict.fromkeys(addresses))
    if is_small(size, req.min_bytes):
        return _one_task(req, base, addresses)
    if req.allreduce:
        if len(distinct) >= 3 and size // len(distinct) >= req.segment_min_bytes:
            specs, roots = segmented_allreduce_specs(
                req.rid, req.op, chosen, addresses, distinct, net, size, req.block_bytes
            )
            return SegmentedAllreduce(**base, specs=tuple(specs), roots=tuple(roots))
        spec = tree_spec(req.rid, req.op, chosen, addresses, net, size, req.block_bytes)
        root = spec.addresses[spec.root]
        copies = tuple(sorted(set(spec.addresses) - {root}))
        if not copies:  # every input on one worker: a plain (restartable) tree
            return Tree(**base, spec=spec)
        return AllreduceTree(**base, spec=dataclasses.replace(spec, copies=copies))
    parts = req.parts
    if parts is None:
        parts = choose_parts(
            "reduce", len(distinct), size, net.bandwidth, net.latency, req.block_bytes
        )
    if parts > 1 and len(distinct) >= 3:
        root_input = addresses.index(req.to) if req.to in addresses else 0
        if req.to is not None and req.to not in addresses:
            addresses[root_input] = req.to  # ``to`` fetches that input first
        specs = split_tree_specs(
            req.rid, req.op, chosen, addresses, root_input, parts, req.block_bytes
        )
        return SplitTrees(**base, specs=tuple(specs))
    spec = tree_spec(
        req.rid, req.op, chosen, addresses, net, size, req.block_bytes, req.to, req.root_input
    )
    spec = dataclasses.replace(spec, spares=tuple(spares))  # in place of an input lost mid-tree
    return Tree(**base, spec=spec, leaves=req.leaves)


def input_worker(key: Key, who_has: Mapping[Key, Sequence[str]], to: str | None) -> str:
    """The worker a plan takes input ``key`` from: ``to`` if it holds it,
    else the first of its holders."""
    holders = sorted(who_has.get(key) or ())
    if not holders:
        raise ReduceInputLost(f"input {key!r} of the reduction has no holder to plan with")
    return to if to is not None and to in holders else holders[0]


def tree_spec(
    rid: str,
    op: str,
    keys: Sequence[Key],
    addresses: Sequence[str],
    net: NetworkEstimate,
    size: int,
    block_bytes: int,
    to: str | None = None,
    root_input: int | None = None,
) -> ReduceSpec:
    """One reduce tree over ``keys`` (held by ``addresses``) shaped by the
    network estimate, with the inputs of one worker next to each other (their
    combination then crosses no NIC); the input at the root's position stays
    there. With ``to``, the root is on worker ``to``: with input
    ``root_input`` if given, else with an input ``to`` holds when there is
    one, else with the first input (which ``to`` then fetches before the
    tree starts)."""
    plan = plan_reduce_tree(len(keys), max_chain_length(size, net.bandwidth, net.latency))
    if root_input is None:
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


def segmented_allreduce_specs(
    rid: str,
    op: str,
    keys: Sequence[Key],
    addresses: Sequence[str],
    distinct: Sequence[str],
    net: NetworkEstimate,
    size: int,
    block_bytes: int,
) -> tuple[list[ReduceSpec], list[int]]:
    """An allreduce as m concurrent reduce-then-broadcast pipelines, one per
    segment of 1/m of the object, each rooted on another of the m workers
    ``distinct``: the trees, and the input slot at each one's root.

    Segment i's reduce chain runs through the workers in the order i+1, i+2,
    ..., i (its root) and its result streams to i+1, i+2, ... as it fills, so
    every worker sends and receives (m-1)/m of the object in each phase:
    2(m-1)/m * S per NIC and direction, the bound, where one tree plus one
    chain of copies would make every worker carry 2 S.
    """
    n, m = len(keys), len(distinct)
    plan = plan_reduce_tree(n, max_chain_length(size // m, net.bandwidth, net.latency))
    positions = [p for p in range(n) if p != plan.root]  # filled in order
    specs = []
    roots = []
    for i, wi in enumerate(distinct):
        rotation = [*distinct[i + 1 :], *distinct[: i + 1]]  # wi last
        rank = {w: r for r, w in enumerate(rotation)}
        root_slot = list(addresses).index(wi)
        others = sorted(
            (s for s in range(n) if s != root_slot), key=lambda s: (rank[addresses[s]], s)
        )
        slot_at = {plan.root: root_slot, **dict(zip(positions, others, strict=True))}
        parent: list[int | None] = [None] * n
        for p in range(n):
            q = plan.parent[p]
            parent[slot_at[p]] = None if q is None else slot_at[q]
        specs.append(
            ReduceSpec(
                rid=segment_rid(rid, i),
                op=op,
                inputs=tuple(keys),
                addresses=tuple(addresses),
                parent=tuple(parent),
                shape=(),
                dtype="",
                block_bytes=block_bytes,
                copies=tuple(rotation[:-1]),
                segment=(i, m),
            )
        )
        roots.append(root_slot)
    return specs, roots


def relocated_spec(
    spec: ReduceSpec,
    who_has: Mapping[Key, Sequence[str]],
    avoid: set[str],
    root: str,
    rid: str,
) -> ReduceSpec:
    """Tree ``spec`` again, as reduction ``rid``, with every input where it
    is now (``who_has``: a holder for each): the root's on ``root``, the
    others on their worker of before if it still holds them and is not in
    ``avoid`` (workers that just failed), else on the first holder outside
    ``avoid`` (any holder if none). A lost input is often recomputed on a
    worker holding another one: the two go next to each other in the tree.
    A segment's tree keeps its segment in its id."""
    keys = list(spec.inputs)
    addresses = []
    for slot, key in enumerate(keys):
        holders = list(who_has[key])
        if slot == spec.root:
            addresses.append(root)
        elif spec.addresses[slot] in holders and spec.addresses[slot] not in avoid:
            addresses.append(spec.addresses[slot])
        else:
            good = [h for h in holders if h not in avoid] or holders
            addresses.append(good[0])
    order = colocated_order(spec.parent, addresses, spec.root)
    return dataclasses.replace(
        spec,
        rid=rid if spec.segment is None else segment_rid(rid, spec.segment[0]),
        inputs=tuple(keys[i] for i in order),
        addresses=tuple(addresses[i] for i in order),
    )
