"""Objects the benchmarks move, made by tasks on the emulated cluster.

* a numpy array (:func:`make_array`): Dask's ``sizeof`` knows its size;
* a :class:`Wrapped` buffer (:func:`make_wrapped`): a plain Python object
  around ``bytes``, as a model from a C library is. Dask's ``sizeof`` has no
  rule for its type and falls back to ``sys.getsizeof``: some 50 bytes,
  whatever the buffer holds. Pickling it copies the buffer in band.

:func:`fingerprint` tells both kinds' contents apart cheaply, to check every
receiver got the object.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class Wrapped:
    """A Python object holding a buffer Dask cannot see."""

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def make_array(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, nbytes // 8, dtype=np.int64)


def make_wrapped(nbytes: int, seed: int) -> Wrapped:
    return Wrapped(np.random.default_rng(seed).bytes(nbytes))


#: The kinds of object ``--object`` chooses, by name.
MAKERS = {"array": make_array, "wrapped": make_wrapped}


def fingerprint(x: Any) -> tuple[int, int]:
    """(bytes, a checksum of a sample of them)."""
    if isinstance(x, Wrapped):
        x = np.frombuffer(x.payload, dtype=np.uint8)
    return int(x.nbytes), int(x[:: max(1, x.size // 4096)].sum())
