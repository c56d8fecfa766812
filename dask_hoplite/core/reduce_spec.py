"""What a reduce tree is, as data: the :class:`ReduceSpec` every node of one
tree receives, the keys of its partial results, and the checks an input must
pass. Pure: no I/O, no event loop.

A spec is made by the planner (:mod:`dask_hoplite.core.reduce_plan`), inside
a plan, and travels as a msgpack-able dict (:meth:`ReduceSpec.to_msg`) to the
root's task and from the root to every node (:mod:`dask_hoplite.worker.reduce_node`).
Slots index the inputs; ``parent[slot]`` is the slot a node streams its partial
result to (None at the root). A tree's id names its run (:func:`run_name`):
the scheduler numbers the runs of a request in order.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dask.typing import Key

from dask_hoplite.core.pytrees import (
    LeafSignature,
    check_signature,
    is_pytree,
    layout_of,
    pack,
    pack_range,
    unpack,
)
from dask_hoplite.core.reduce_ops import reference
from dask_hoplite.errors import ReduceInputError

#: First element of a partial result's key: ``(PARTIAL, rid, slot)``.
PARTIAL = "hoplite-reduce"
#: Third element of the key of a dead node's input served for a patch.
INPUT_PATCH = "input-"

#: Between a reduction's id and a segment's number in a segment tree's id.
SEGMENT_TAG = "-s"


def segment_rid(rid: str, segment: int) -> str:
    """The id of segment ``segment``'s tree of reduction ``rid`` (a reduce in
    parts, or a segmented allreduce)."""
    return f"{rid}{SEGMENT_TAG}{segment}"


#: Between a request's id and a run's number in a run's id: the scheduler's
#: reduction coordinator numbers every run it plans, ``<request>-r<n>``; a
#: tree of the run appends its segment (``-s<i>``) or pytree leaf (``-<j>``).
RUN_TAG = "-r"
_RUN_ID = re.compile(rf"^(?P<request>.+?){RUN_TAG}(?P<n>\d+)(?P<suffix>(-s?\d+)*)$")

#: How many trees' latest run numbers the coordinator and each worker
#: remember, to tell a stale run (the oldest are forgotten first).
REMEMBERED_TREES = 10_000


class LatestRuns:
    """The latest run number seen of each tree (:attr:`RunName.tree`), for
    the ``limit`` trees seen most recently: what the scheduler's coordinator
    and each worker tell a stale run by."""

    def __init__(self, limit: int = REMEMBERED_TREES) -> None:
        self._runs: OrderedDict[str, int] = OrderedDict()
        self._limit = limit

    def get(self, tree: str) -> int | None:
        """The latest run of ``tree`` seen (None: none is remembered)."""
        return self._runs.get(tree)

    def record(self, tree: str, number: int) -> None:
        """Run ``number`` of ``tree`` was seen (an earlier one changes nothing)."""
        self._runs[tree] = max(number, self._runs.get(tree, number))
        self._runs.move_to_end(tree)
        while len(self._runs) > self._limit:
            self._runs.popitem(last=False)


def run_rid(request: str, n: int) -> str:
    """The id of run ``n`` of reduction request ``request``."""
    return f"{request}{RUN_TAG}{n}"


@dataclass(frozen=True)
class RunName:
    """What a tree's id says of its run: the request it runs, the run's
    number, and which of the run's trees it is (``suffix``: ``""`` for the
    whole reduction, else its segment or pytree leaf). A later run of the
    same tree has a higher number."""

    request: str
    number: int
    suffix: str

    @property
    def tree(self) -> str:
        """The tree that runs again under a new number: request and suffix."""
        return self.request + self.suffix

    def later(self, number: int) -> str:
        """The id of this tree in run ``number``."""
        return f"{run_rid(self.request, number)}{self.suffix}"


def run_name(rid: str) -> RunName | None:
    """The run named by tree id ``rid``; None for an id the coordinator did
    not number (a reduction planned on a cluster without the plugin)."""
    m = _RUN_ID.match(rid)
    if m is None:
        return None
    return RunName(m["request"], int(m["n"]), m["suffix"])


@dataclass(frozen=True)
class ReduceSpec:
    """Everything a node needs to know; travels as a msgpack-able dict."""

    rid: str
    op: str
    inputs: tuple[Key, ...]  # by slot
    addresses: tuple[str, ...]  # by slot: the worker holding that input
    parent: tuple[int | None, ...]  # by slot
    shape: tuple[int, ...]
    dtype: str  # the inputs' dtype
    block_bytes: int
    #: allreduce: workers that receive the result as it is being reduced, in
    #: chain order (the first streams the root's partial result, each next one
    #: streams the copy before it).
    copies: tuple[str, ...] = ()
    #: Inputs are dicts of arrays (e.g. the per-chunk results of a dask.array
    #: mean): reduce this entry of each.
    field: str | None = None
    #: Reduce only segment ``i`` of ``m`` equal parts of the flattened inputs
    #: (a segmented allreduce, or a reduce in parts: ``split_tree_specs``);
    #: ``shape`` stays the inputs' full shape.
    segment: tuple[int, int] | None = None
    #: The root's input is a pytree of this signature (every leaf's path,
    #: shape and dtype: :mod:`dask_hoplite.core.pytrees`), reduced as one
    #: flat array; ``shape`` is that array's. None: the inputs are arrays.
    signature: tuple[LeafSignature, ...] | None = None
    #: Inputs of the reduction left out of this tree (with ``k < n``): when a
    #: node's input is lost with its worker, the root restarts the tree with a
    #: ready spare in its place (a plain tree only: :func:`with_spares`).
    spares: tuple[Key, ...] = ()

    def to_msg(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "op": self.op,
            "inputs": list(self.inputs),
            "addresses": list(self.addresses),
            "parent": list(self.parent),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "block_bytes": self.block_bytes,
            "copies": list(self.copies),
            "field": self.field,
            "segment": list(self.segment) if self.segment is not None else None,
            "signature": (
                [[p, list(shape), dt] for p, shape, dt in self.signature]
                if self.signature is not None
                else None
            ),
            "spares": list(self.spares),
        }

    @classmethod
    def from_msg(cls, m: dict[str, Any]) -> ReduceSpec:
        return cls(
            m["rid"],
            m["op"],
            tuple(m["inputs"]),
            tuple(m["addresses"]),
            tuple(m["parent"]),
            tuple(m["shape"]),
            m["dtype"],
            int(m["block_bytes"]),
            tuple(m.get("copies") or ()),
            m.get("field"),
            tuple(m["segment"]) if m.get("segment") is not None else None,
            (
                tuple((p, tuple(shape), dt) for p, shape, dt in m["signature"])
                if m.get("signature") is not None
                else None
            ),
            tuple(m.get("spares") or ()),
        )

    def bounds(self) -> tuple[int, int]:
        """The element range [lo, hi) of the flattened inputs this tree reduces."""
        n = math.prod(self.shape)
        if self.segment is None:
            return 0, n
        i, m = self.segment
        return n * i // m, n * (i + 1) // m

    def node_shape(self) -> tuple[int, ...]:
        """The shape of every node's partial result."""
        if self.segment is None:
            return tuple(self.shape)
        lo, hi = self.bounds()
        return (hi - lo,)

    @property
    def is_allreduce(self) -> bool:
        """Copies stream the result as it is reduced: an allreduce, which has
        its own fallback and is neither repaired nor restarted as a tree."""
        return bool(self.copies)

    @property
    def reduction_rid(self) -> str:
        """The id of the whole reduction this tree is part of."""
        return self.rid if self.segment is None else self.rid.rsplit(SEGMENT_TAG, 1)[0]

    def children(self, slot: int) -> list[int]:
        return [i for i, p in enumerate(self.parent) if p == slot]

    @property
    def root(self) -> int:
        return self.parent.index(None)

    def partial_key(self, slot: int) -> tuple[str, str, int]:
        return partial_key(self.rid, slot)

    def input_patch_key(self, slot: int) -> tuple[str, str, str]:
        """Key under which the worker that recomputed dead node ``slot``'s
        input serves a patch of it (:mod:`dask_hoplite.core.tree_spread`)."""
        return (PARTIAL, self.rid, f"{INPUT_PATCH}{slot}")

    def copy_key(self, j: int) -> tuple[str, str, int]:
        """Key of allreduce copy ``j`` (negative slots: never a tree node)."""
        return (PARTIAL, self.rid, -1 - j)

    def copy_source(self, j: int) -> tuple[str, tuple[str, str, int]]:
        """Where copy ``j`` streams from: the root's partial result, or copy j-1."""
        if j == 0:
            return self.addresses[self.root], self.partial_key(self.root)
        return self.copies[j - 1], self.copy_key(j - 1)


def with_spares(
    spec: ReduceSpec,
    holders: Mapping[Key, Sequence[str]],
    avoid: set[str],
) -> tuple[ReduceSpec, dict[Key, Key]]:
    """``spec`` with every input that has no holder outside ``avoid`` (lost
    with its worker) replaced by a spare that has one, in the order of
    ``spec.spares``, and what replaced what (lost input -> spare). The
    root's input is never replaced: the root holds it. Segment trees keep
    their inputs: the segments of one result must all reduce the same ones."""
    if spec.segment is not None or spec.is_allreduce:
        return spec, {}

    def held(key: Key) -> bool:
        return bool(set(holders.get(key) or ()) - avoid)

    ready = [key for key in spec.spares if held(key)]
    inputs, swaps = list(spec.inputs), {}
    for slot, key in enumerate(inputs):
        if slot != spec.root and not held(key) and ready:
            inputs[slot] = swaps[key] = ready.pop(0)
    if not swaps:
        return spec, {}
    spares = tuple(key for key in spec.spares if key not in swaps.values())
    return dataclasses.replace(spec, inputs=tuple(inputs), spares=spares), swaps


def join_segments(
    shape: tuple[int, ...],
    specs: list[ReduceSpec],
    segments: list[np.ndarray],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The whole result of ``shape`` from the results of segment trees
    ``specs`` (``segments[i]`` is ``specs[i]``'s), written into the flat
    array ``out`` if given."""
    count = math.prod(shape)
    flat = np.empty(count, dtype=segments[0].dtype) if out is None else out
    for spec, seg in zip(specs, segments, strict=True):
        lo, hi = dataclasses.replace(spec, shape=shape).bounds()
        seg = np.asarray(seg).reshape(-1)
        if not _same_bytes(flat[lo:hi], seg):  # a segment made in place is not copied
            flat[lo:hi] = seg
    return flat.reshape(shape)


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """``a`` and ``b`` are the same memory, as the same values."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    )


def partial_key(rid: str, slot: int) -> tuple[str, str, int]:
    """The key of node ``slot``'s partial result in reduce tree ``rid``."""
    return (PARTIAL, rid, slot)


def is_partial_key(key: object) -> bool:
    return isinstance(key, tuple) and len(key) == 3 and key[0] == PARTIAL


def is_input_patch_key(key: object) -> bool:
    return is_partial_key(key) and str(key[2]).startswith(INPUT_PATCH)  # type: ignore[index]


def select_field(value: Any, field: str | None, key: Key) -> Any:
    """The operand of input ``key``: the value itself, or its entry ``field``."""
    if field is None:
        return value
    if not isinstance(value, dict) or field not in value:
        raise ReduceInputError(
            f"input {key!r} of the reduction is a {type(value).__name__} without an entry {field!r}"
        )
    return value[field]


def check_input(
    value: Any,
    key: Key,
    like: tuple[Key, tuple[int, ...], Any] | None = None,
    signature: Sequence[LeafSignature] | None = None,
) -> np.ndarray:
    """``value`` as a numpy array (a pytree packed into one flat array:
    :func:`~dask_hoplite.core.pytrees.pack`),
    or a :class:`ReduceInputError` naming ``key`` when it is not a numeric
    numpy array or pytree or, given ``like = (reference key, shape, dtype)``
    and the reference input's pytree ``signature`` (None: an array), has
    another shape or dtype or structure than that reference input."""
    if is_pytree(value):
        packed = pack(value, key)
        if like is not None:
            check_signature(packed.layout.signature, key, signature, like[0])
        value = packed.flat
    elif like is not None and signature is not None:
        raise ReduceInputError(
            f"input {key!r} of the reduction is a {type(value).__name__} but input "
            f"{like[0]!r} is a pytree: all inputs must have one structure"
        )
    if isinstance(value, np.generic):  # Dask may hand 0-d arrays over as scalars
        value = np.asarray(value)
    if not isinstance(value, np.ndarray) or value.dtype.fields is not None:
        raise ReduceInputError(
            f"input {key!r} of the reduction is a "
            f"{getattr(value, 'dtype', type(value).__name__)}; reductions take numpy "
            "arrays of a numeric dtype"
        )
    if like is not None:
        ref_key, shape, dtype = like
        if value.shape != tuple(shape) or value.dtype != np.dtype(dtype):
            raise ReduceInputError(
                f"input {key!r} has shape {value.shape} and dtype {value.dtype}, but input "
                f"{ref_key!r} has shape {tuple(shape)} and dtype {np.dtype(dtype)}: all "
                "inputs of a reduction must have one shape and dtype"
            )
    return value


def input_range(
    value: Any,
    key: Key,
    like: tuple[Key, tuple[int, ...], Any] | None,
    signature: Sequence[LeafSignature] | None,
    lo: int,
    hi: int,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """Elements ``[lo, hi)`` of input ``value`` seen as one flat array, after
    the checks of :func:`check_input`: what a node of a tree over that range
    combines. A pytree packs only the leaves' bytes in the range, into memory
    from ``allocate``; an array's range is a view where it is contiguous."""
    if is_pytree(value):
        layout, arrays = layout_of(value, key)
        if like is not None:
            check_signature(layout.signature, key, signature, like[0])
        return pack_range(layout, arrays, lo, hi, allocate)
    return check_input(value, key, like, signature).reshape(-1)[lo:hi]


def with_root_input(spec: ReduceSpec, value: Any) -> ReduceSpec:
    """``spec`` with the shape and dtype of the root's input ``value`` (a
    pytree's flat array's, and its signature), which every input must match."""
    key = spec.inputs[spec.root]
    if is_pytree(value):
        layout = layout_of(value, key)[0]
        signature = tuple(layout.signature)
        return dataclasses.replace(
            spec, shape=(layout.size,), dtype=layout.dtype, signature=signature
        )
    value = check_input(value, key)
    return dataclasses.replace(spec, shape=value.shape, dtype=value.dtype.str, signature=None)


def as_input(value: Any, key: Key, result: Any) -> Any:
    """A reduction's flat ``result`` in the shape of input ``value`` (input
    ``key``): unpacked where that is a pytree; as it is otherwise, or where
    it was unpacked already."""
    if not is_pytree(value) or not isinstance(result, np.ndarray):
        return result
    return unpack(layout_of(value, key)[0], result)


def flat_shape(value: Any, key: Key) -> tuple[int, ...]:
    """The shape of input ``value`` (input ``key``) as a reduction sees it:
    a pytree's flat array's."""
    return (layout_of(value, key)[0].size,) if is_pytree(value) else np.shape(value)


def reduce_values(op: str, keys: list[Key], values: list[Any]) -> Any:
    """The reduction of ``values`` (the inputs ``keys``) in one place, in the
    order given: what small objects get instead of a tree. Pytrees are
    reduced as one flat array each, and the result unpacked in the first's
    shape."""
    packed = pack(values[0], keys[0]) if is_pytree(values[0]) else None
    first = check_input(values[0] if packed is None else packed.flat, keys[0])
    like = (keys[0], first.shape, first.dtype)
    signature = None if packed is None else packed.layout.signature
    rest = [
        check_input(v, key, like, signature) for key, v in zip(keys[1:], values[1:], strict=True)
    ]
    result = reference(op, [first, *rest])
    return result if packed is None else unpack(packed.layout, result)
