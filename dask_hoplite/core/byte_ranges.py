"""A key received in byte ranges: a transparent broadcast in parts.

When many workers fetch one large key (tasks on each of them share the
dependency), the directory may split the key's bytes into ``k`` contiguous
ranges, each streamed down its own tree (the split trees of
:mod:`~dask_hoplite.core.split_trees`): every host then sends the object once
and the depth is about ``log_k(hosts)`` instead of one hop per host. Unlike
:func:`dask_hoplite.broadcast` with ``parts``, nothing is cut or joined: every
receiver fills one buffer of the whole object, range by range
(:class:`~dask_hoplite.core.store.ObjectBuffer` with ranges), and serves each
range on from there as it lands.

The directory tracks each range as a key of its own, :func:`range_key`; Dask
knows only the whole key. Pure functions, no I/O.
"""

from __future__ import annotations

from typing import Any

from dask.typing import Key

#: The first element of a range's directory key.
RANGE = "hoplite-range"


def range_bounds(nbytes: int, part: int, parts: int) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of range ``part`` of ``parts`` of an object of
    ``nbytes`` (near-equal contiguous ranges, covering it exactly)."""
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"range {part} of {parts} does not exist")
    return nbytes * part // parts, nbytes * (part + 1) // parts


def range_key(key: Key, part: int, parts: int) -> tuple[str, Key, int, int]:
    """The directory's key of range ``part`` of ``parts`` of Dask's ``key``."""
    return (RANGE, key, part, parts)


def describe(key: Any) -> str:
    """A directory key as people read it: Dask's key, with its range if any."""
    if whole_key(key) is None:
        return str(key)
    _, whole, part, parts = key
    return f"{whole} (range {part + 1}/{parts})"


def whole_key(key: Any) -> Key | None:
    """Dask's key of a range's directory key (None: ``key`` is no range's)."""
    if isinstance(key, tuple) and len(key) == 4 and key[0] == RANGE:
        whole: Key = key[1]
        return whole
    return None
