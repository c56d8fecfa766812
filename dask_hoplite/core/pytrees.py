"""Models as pytrees: a nesting of dicts, lists and tuples whose leaves are
arrays, packed into one flat array for a reduction and unpacked after.
Pure: no I/O, no event loop.

A reduction streams one flat array up one tree, so a model (a dict of layer
weights, a PyTorch ``state_dict``) is reduced as one object: :func:`pack`
copies its leaves, in a canonical order, into one flat array of their dtype,
every edge of the tree carries all the leaves in one stream, and
:func:`unpack` gives the result back in the input's shape, each leaf a view
of the flat result, as the type it went in.

What a leaf may be, and the type it comes back as:

- a numpy array (an array), a numpy scalar (a numpy scalar), a Python
  ``int``, ``float`` or ``complex`` (the Python number of the result; it
  takes the dtype of the array leaves, as numpy's promotion does, so a step
  count in a float32 model comes back as a float);
- a CPU ``torch.Tensor`` (a tensor sharing the result's memory);
- any other object with ``__array__`` or the buffer protocol: numpy reads it,
  and it comes back as ``type(leaf).from_numpy(array)`` when its type has
  that, else ``type(leaf)(array)``.

Every leaf of one input must have one numeric dtype (the result's is the
operator's, e.g. a float for the ``mean`` of ints). Each input's
:attr:`Layout.signature` (every leaf's path, shape and dtype) must equal the
others': :func:`check_signature` names the first leaf that differs.

Dict keys are taken in sorted order (in their insertion order where they do
not sort), so inputs whose dicts were filled in different orders agree; the
result has the root input's order. A bare numpy array is not a pytree: it is
reduced as it is, without a copy (:func:`is_pytree`).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dask_hoplite.errors import ReduceInputError

#: One leaf's path, shape and dtype, as a message carries them.
LeafSignature = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True)
class Leaf:
    """One leaf of a packed pytree: where it sits, its place in the flat
    array, and how it is rebuilt (``kind``: 'array', 'numpy-scalar',
    'python', 'torch' or 'object'; ``cls``: the leaf's type)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    start: int
    kind: str
    cls: type

    @property
    def size(self) -> int:
        return math.prod(self.shape)


#: A container's shape: ('dict', type, keys in the input's order, children in
#: packing order), ('list', type, children) or ('tuple', type, children); a
#: leaf is the int of its index in :attr:`Layout.leaves`.
TreeDef = Any


@dataclass(frozen=True)
class Layout:
    """What :func:`unpack` needs to rebuild a packed pytree."""

    treedef: TreeDef
    leaves: tuple[Leaf, ...]
    dtype: str

    @property
    def signature(self) -> list[LeafSignature]:
        """Every leaf's path, shape and dtype, in packing order: two inputs
        can be reduced together when theirs are equal. A list of tuples, as
        it travels in a reduce tree's spec."""
        return [(leaf.path, leaf.shape, leaf.dtype) for leaf in self.leaves]

    @property
    def size(self) -> int:
        """The number of elements of the flat array."""
        return sum(leaf.size for leaf in self.leaves)


@dataclass(frozen=True)
class Packed:
    """A pytree's leaves in one flat array, and its layout."""

    flat: np.ndarray
    layout: Layout


def is_pytree(value: Any) -> bool:
    """``value`` is reduced through :func:`pack`: a dict, list or tuple, or
    one leaf that is not a numpy array (a tensor, a Python number)."""
    if isinstance(value, np.ndarray | np.generic):
        return False
    return isinstance(value, dict | list | tuple) or _is_array_like(value)


def _is_array_like(value: Any) -> bool:
    if isinstance(value, int | float | complex) or hasattr(value, "__array__"):
        return True
    try:
        memoryview(value)
    except TypeError:
        return False
    return True


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    try:
        return sorted(d)
    except TypeError:  # keys of types that do not compare
        return list(d)


def _flatten(value: Any, path: str, leaves: list[tuple[str, Any]]) -> TreeDef:
    if isinstance(value, dict):
        keys = _sorted_keys(value)
        children = [_flatten(value[k], f"{path}[{k!r}]", leaves) for k in keys]
        position = {k: i for i, k in enumerate(keys)}
        order = [position[k] for k in value]
        return ("dict", type(value), tuple(keys), tuple(children), tuple(order))
    if isinstance(value, list | tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        children = [_flatten(v, f"{path}[{i}]", leaves) for i, v in enumerate(value)]
        return (kind, type(value), tuple(children))
    leaves.append((path, value))
    return len(leaves) - 1


def _leaf_array(path: str, leaf: Any, key: Any) -> tuple[np.ndarray, str]:
    """A leaf as a numpy array (a view where the leaf allows), and its kind."""
    cls = type(leaf)
    if isinstance(leaf, np.ndarray):
        arr, kind = leaf, "array"
    elif isinstance(leaf, np.generic):
        arr, kind = np.asarray(leaf), "numpy-scalar"
    elif not _is_array_like(leaf):
        raise ReduceInputError(
            f"leaf {path or '(the input)'} of input {key!r} is a {cls.__name__}; the leaves "
            "of a reduced pytree are arrays: numpy arrays, tensors, numbers, or objects "
            "with __array__ or the buffer protocol"
        )
    elif isinstance(leaf, int | float | complex):
        arr, kind = np.asarray(leaf), "python"
    elif _is_torch_tensor(leaf):
        arr, kind = leaf.detach().cpu().numpy(), "torch"
    else:
        arr, kind = np.asarray(leaf), "object"
    if arr.dtype.kind not in "biufc":
        raise ReduceInputError(
            f"leaf {path or '(the input)'} of input {key!r} is a {cls.__name__} of dtype "
            f"{arr.dtype}; reductions take numeric dtypes"
        )
    return arr, kind


def _is_torch_tensor(leaf: Any) -> bool:
    return type(leaf).__module__.split(".")[0] == "torch" and hasattr(leaf, "detach")


def layout_of(value: Any, key: Any) -> tuple[Layout, list[np.ndarray]]:
    """The layout of pytree ``value`` (input ``key``) and its leaves as numpy
    arrays, in packing order; a :class:`ReduceInputError` naming the leaf
    when one is not an array of a numeric dtype, or when the leaves have
    several dtypes."""
    found: list[tuple[str, Any]] = []
    treedef = _flatten(value, "", found)
    if not found:
        raise ReduceInputError(f"input {key!r} of the reduction is a pytree without leaves")
    arrays: list[np.ndarray] = []
    leaves: list[Leaf] = []
    start = 0
    for path, leaf in found:
        arr, kind = _leaf_array(path, leaf, key)
        leaves.append(Leaf(path, tuple(arr.shape), arr.dtype.str, start, kind, type(leaf)))
        arrays.append(arr)
        start += arr.size
    typed = {leaf.dtype for leaf in leaves if leaf.kind != "python"}
    if len(typed) == 1 and any(leaf.kind == "python" for leaf in leaves):
        # Python numbers are weakly typed (as in numpy's own promotion):
        # they take the dtype of the array leaves.
        [dtype] = typed
        for i, leaf in enumerate(leaves):
            if leaf.kind == "python":
                arrays[i] = arrays[i].astype(dtype)
                leaves[i] = dataclasses.replace(leaf, dtype=dtype)
    dtypes: dict[str, list[str]] = {}
    for leaf in leaves:
        dtypes.setdefault(np.dtype(leaf.dtype).name, []).append(leaf.path or "(the input)")
    if len(dtypes) > 1:
        listed = "; ".join(f"{dt}: {', '.join(paths[:4])}" for dt, paths in dtypes.items())
        raise ReduceInputError(
            f"the leaves of input {key!r} have {len(dtypes)} dtypes ({listed}); a reduction "
            "takes pytrees whose leaves share one dtype: cast them, or reduce the leaves "
            "of each dtype in a call of their own"
        )
    return Layout(treedef, tuple(leaves), leaves[0].dtype), arrays


def pack(value: Any, key: Any, allocate: Callable[[int], np.ndarray] | None = None) -> Packed:
    """Pytree ``value`` (input ``key``) in one flat array (:func:`pack_range`
    of all of it)."""
    layout, arrays = layout_of(value, key)
    return Packed(pack_range(layout, arrays, 0, layout.size, allocate), layout)


def pack_range(
    layout: Layout,
    arrays: list[np.ndarray],
    lo: int,
    hi: int,
    allocate: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """Elements ``[lo, hi)`` of the flat array of a pytree (``layout`` and
    ``arrays`` from :func:`layout_of`): a view of its one leaf where that is
    contiguous, else the leaves' elements copied into new memory (from
    ``allocate(nbytes)``, a uint8 array of at least that many bytes, if
    given: e.g. a worker's recycled buffers). Only that range is copied."""
    if len(arrays) == 1 and arrays[0].flags.c_contiguous:
        return arrays[0].reshape(-1)[lo:hi]
    dtype = np.dtype(layout.dtype)
    count = hi - lo
    if allocate is None:
        flat = np.empty(count, dtype=dtype)
    else:
        flat = allocate(count * dtype.itemsize)[: count * dtype.itemsize].view(dtype)
    for leaf, arr in zip(layout.leaves, arrays, strict=True):
        a, b = max(lo, leaf.start), min(hi, leaf.start + leaf.size)
        if a < b:
            np.copyto(flat[a - lo : b - lo], arr.reshape(-1)[a - leaf.start : b - leaf.start])
    return flat


def unpack(layout: Layout, flat: np.ndarray) -> Any:
    """The pytree of ``layout`` whose leaves are the elements of ``flat`` (a
    reduction's result: same size, the result's dtype), each a view, rebuilt
    as the type it went in."""
    flat = np.asarray(flat).reshape(-1)
    if flat.size != layout.size:
        raise ValueError(f"a flat array of {flat.size} elements for a layout of {layout.size}")
    leaves = [_rebuild(leaf, flat[leaf.start : leaf.start + leaf.size]) for leaf in layout.leaves]
    return _build(layout.treedef, leaves)


def _build(treedef: TreeDef, leaves: list[Any]) -> Any:
    if isinstance(treedef, int):
        return leaves[treedef]
    kind, cls = treedef[0], treedef[1]
    if kind == "dict":
        keys, children, order = treedef[2], treedef[3], treedef[4]
        built = {k: _build(c, leaves) for k, c in zip(keys, children, strict=True)}
        items = [(keys[i], built[keys[i]]) for i in order]
        return _container(cls, dict, items)
    values = [_build(c, leaves) for c in treedef[2]]
    if kind == "tuple" and hasattr(cls, "_fields"):  # a namedtuple
        return cls(*values)
    return _container(cls, list if kind == "list" else tuple, values)


def _container(cls: type, base: type, items: list[Any]) -> Any:
    """A container of type ``cls`` holding ``items``; of type ``base`` where
    ``cls`` cannot be made from them (e.g. a defaultdict)."""
    if cls is base:
        return base(items)
    try:
        return cls(items)
    except TypeError:
        return base(items)


def _rebuild(leaf: Leaf, flat: np.ndarray) -> Any:
    arr = flat.reshape(leaf.shape)
    if leaf.kind == "array":
        return arr
    if leaf.kind == "numpy-scalar":
        return arr[()]
    if leaf.kind == "python":
        return arr.item()
    if leaf.kind == "torch":
        return _torch_from_numpy(leaf.cls, arr)
    make: Callable[[np.ndarray], Any] = getattr(leaf.cls, "from_numpy", leaf.cls)
    try:
        return make(arr)
    except Exception as e:
        raise TypeError(
            f"leaf {leaf.path or '(the result)'} cannot be rebuilt as a {leaf.cls.__name__} "
            f"from a numpy array ({e}); give {leaf.cls.__name__} a from_numpy classmethod"
        ) from e


def _torch_from_numpy(cls: type, arr: np.ndarray) -> Any:
    # The leaf's type is torch's: torch is loaded (not a dependency here).
    torch = sys.modules[cls.__module__.split(".")[0]]
    if not arr.flags.writeable:  # torch shares memory only with writable arrays
        arr = arr.copy()
    return torch.from_numpy(arr)


def check_signature(
    signature: Sequence[LeafSignature],
    key: Any,
    reference: Sequence[LeafSignature] | None,
    ref_key: Any,
) -> None:
    """A :class:`ReduceInputError` naming the first leaf where input ``key``'s
    ``signature`` differs from input ``ref_key``'s ``reference`` (None: that
    input is a numpy array, not a pytree)."""
    if reference is None:
        raise ReduceInputError(
            f"input {key!r} of the reduction is a pytree but input {ref_key!r} is a "
            "numpy array: all inputs must have one structure"
        )
    mine = {path: (tuple(shape), dtype) for path, shape, dtype in signature}
    theirs = {path: (tuple(shape), dtype) for path, shape, dtype in reference}
    for path in theirs:
        if path not in mine:
            raise ReduceInputError(
                f"input {key!r} has no leaf {path or '(the input)'}, which input "
                f"{ref_key!r} has: all inputs must have one structure"
            )
    for path, (shape, dtype) in mine.items():
        if path not in theirs:
            raise ReduceInputError(
                f"input {key!r} has a leaf {path or '(the input)'} that input {ref_key!r} "
                "has not: all inputs must have one structure"
            )
        ref_shape, ref_dtype = theirs[path]
        if (shape, dtype) != (ref_shape, ref_dtype):
            raise ReduceInputError(
                f"leaf {path or '(the input)'} of input {key!r} has shape {shape} and dtype "
                f"{np.dtype(dtype)}, but in input {ref_key!r} it has shape {ref_shape} and "
                f"dtype {np.dtype(ref_dtype)}: every leaf must have one shape and dtype "
                "in all inputs"
            )
    if [s[0] for s in signature] != [s[0] for s in reference]:
        raise ReduceInputError(
            f"input {key!r} has the leaves of input {ref_key!r} in another nesting: all "
            "inputs must have one structure"
        )
