"""Cutting an object into parts and joining them again, for the split-tree
broadcast (:func:`dask_hoplite.broadcast` with ``parts``).

Pure functions, run as Dask tasks through :mod:`dask_hoplite.worker.tasks`. A C-contiguous NumPy array is cut without
a copy (the parts are views of its flat form); any other object is pickled
once and its bytes are cut. Joining copies the parts into one new object.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

#: What :func:`join_parts` needs to rebuild the object: ("ndarray", shape,
#: dtype) or ("pickle",).
Meta = tuple[Any, ...]


def flatten(x: Any) -> np.ndarray:
    """``x`` as one flat array (a view when ``x`` is a C-contiguous array
    of a plain dtype, its pickled bytes otherwise)."""
    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        return np.ascontiguousarray(x).reshape(-1)
    return np.frombuffer(pickle.dumps(x, protocol=5), dtype=np.uint8)


def meta_of(x: Any) -> Meta:
    """How to turn the joined flat array back into ``x``."""
    if isinstance(x, np.ndarray) and not x.dtype.hasobject:
        return ("ndarray", x.shape, x.dtype)
    return ("pickle",)


def part_of(flat: np.ndarray, j: int, parts: int) -> np.ndarray:
    """Part ``j`` of ``parts`` of ``flat`` (near-equal contiguous slices, views)."""
    if not 0 <= j < parts:
        raise ValueError(f"part {j} is not in range({parts})")
    n = len(flat)
    return flat[n * j // parts : n * (j + 1) // parts]


def join_parts(meta: Meta, *parts: np.ndarray) -> Any:
    """The object the parts were cut from (a new copy)."""
    flat = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)
    if meta[0] == "ndarray":
        _, shape, dtype = meta
        return flat.astype(dtype, copy=False).reshape(shape)
    return pickle.loads(flat.tobytes())
