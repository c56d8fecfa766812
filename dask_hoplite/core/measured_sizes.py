"""Objects whose size Dask's estimate gets wrong, and the sizes measured instead.

Dask sizes a task's result with :func:`dask.sizeof.sizeof`. For a type it has
no rule for, that falls back to :func:`sys.getsizeof`, which counts the Python
object and none of what it refers to: a trained model from a C library, or any
class wrapping a 55 MB buffer, reports some 50 bytes. Hoplite takes a key when
its size reaches ``hoplite.min-bytes``, so such a key would never travel as a
tree, however many workers need it.

Two things live here, both plain and IO-free:

* :func:`sizeof_may_be_wrong`: whether Dask's estimate of a value can be
  trusted. The worker that computed a value it cannot trust serialises it once
  (:mod:`dask_hoplite.worker.measuring`) and reports what it measured.
* :class:`MeasuredSizes`: the scheduler's record of those measurements: the
  size to plan with (the larger of Dask's estimate and the measurement), and
  which workers must be told before a task of theirs needs such a key (a
  worker decides by itself whether to fetch a key through hoplite, and it
  must know before its fetch starts).

Dask's own metadata (``TaskState.nbytes``, on the scheduler and on workers)
is never changed: its memory accounting stays Dask's.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from typing import Any

from dask.sizeof import sizeof

#: Items of a list, tuple, set or dict looked at (as Dask's own ``sizeof``
#: samples a collection rather than walking it whole).
SAMPLE = 10
#: How deep into nested collections the check looks.
DEPTH = 2

_COLLECTIONS = (list, tuple, set, frozenset)

#: Stream op: a holder's report of a key it measured, to the scheduler.
MEASURED_OP = "hoplite-measured"
#: Stream op: the measured keys a task sent to a worker needs, from the scheduler.
SIZES_OP = "hoplite-sizes"


def _default_rule() -> Any:
    return sizeof.dispatch(object)


def sizeof_may_be_wrong(value: object, depth: int = DEPTH) -> bool:
    """Whether :func:`dask.sizeof.sizeof` may underestimate ``value`` badly.

    True for an object of a type Dask has no sizing rule for, other than
    Python's own built-in types (whose ``sys.getsizeof`` is right: ints,
    strings, None...); and for a list, tuple, set or dict whose sampled items
    are such objects (Dask sizes a collection from a sample of its items)."""
    rule = sizeof.dispatch(type(value))
    if rule is _default_rule():
        return type(value).__module__ != "builtins"
    if depth <= 0:
        return False
    items: Iterable[object]
    if isinstance(value, dict):
        items = itertools.islice(value.values(), SAMPLE)
    elif isinstance(value, _COLLECTIONS):
        items = itertools.islice(value, SAMPLE)
    else:
        return False
    return any(sizeof_may_be_wrong(v, depth - 1) for v in items)


class MeasuredSizes:
    """The scheduler's record of keys a worker measured as serialised.

    Events in: :meth:`measured` (a worker's report), :meth:`forget` (Dask
    released or forgot the key), :meth:`consumer_placed` (a task that needs
    some keys was sent to a worker); that last one returns what to tell the
    worker first. Nothing is kept for a key that measured under
    ``min_bytes``: workers report only the large ones."""

    def __init__(self) -> None:
        #: key -> its serialised size, as its holder measured it.
        self.sizes: dict[Hashable, int] = {}
        #: key -> the workers already told its size.
        self.told: dict[Hashable, set[str]] = {}

    def measured(self, key: Hashable, nbytes: int) -> None:
        """A worker computed ``key`` and measured it as ``nbytes`` serialised."""
        self.sizes[key] = int(nbytes)
        self.told.setdefault(key, set())

    def size(self, key: Hashable, estimate: int | None) -> int:
        """The size to plan ``key``'s transfers with: Dask's ``estimate``, or
        the measurement where it is larger."""
        return max(estimate or 0, self.sizes.get(key, 0))

    def forget(self, key: Hashable) -> None:
        """Dask released or forgot ``key`` (a recomputation measures anew)."""
        self.sizes.pop(key, None)
        self.told.pop(key, None)

    def worker_removed(self, address: str) -> None:
        for told in self.told.values():
            told.discard(address)

    def consumer_placed(self, worker: str, dependencies: Iterable[Hashable]) -> dict[Hashable, int]:
        """A task needing ``dependencies`` goes to ``worker``: the measured
        ones it was not told of yet, with their sizes (it is told now)."""
        out: dict[Hashable, int] = {}
        for key in dependencies:
            n = self.sizes.get(key)
            if n is None or worker in self.told[key]:
                continue
            self.told[key].add(worker)
            out[key] = n
        return out

    def __len__(self) -> int:
        return len(self.sizes)
