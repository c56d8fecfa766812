"""Reversible replacements of Dask internals on a live scheduler or worker.

Each override of the scheduler part (:mod:`dask_hoplite.scheduler.replicate`,
:mod:`~dask_hoplite.graph_reductions.scheduler_hook`, :mod:`~dask_hoplite.scheduler.amm`)
and of the worker part (``Worker.gather_dep``, the ``gather`` handler, the
peer handlers, ``Worker.handle_stimulus``) replaces an attribute or a handler
entry of an object it does not own. Undoing that by hand invites subtle
differences (setting back a bound method as an instance attribute, removing an
entry that was never ours, undoing someone else's replacement made after
ours); the two records here remember exactly what was there and put back
exactly that, once, and only while the value there is still ours. Each
override is one record, so that it can be switched on or off on its own.
:class:`Override` is the shape the scheduler plugin expects of each override.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from distributed import Scheduler

_ABSENT = object()


class Override(Protocol):
    """A replacement of a Dask internal; ``restore`` undoes ``install`` exactly,
    and both may be called again without effect."""

    def install(self, scheduler: Scheduler) -> None: ...

    def restore(self) -> None: ...


class AttributePatch:
    """``setattr(obj, name, value)`` at construction; :meth:`undo` restores the
    instance attribute that was there before, or removes it if there was none
    (so the class attribute, typically the original method, shows again)."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self._obj: Any = obj
        self._name = name
        self._previous = vars(obj).get(name, _ABSENT)
        self._value = value
        setattr(obj, name, value)

    def undo(self) -> None:
        obj, self._obj = self._obj, None
        if obj is None or vars(obj).get(self._name, _ABSENT) != self._value:
            return  # undone already, or replaced after us: theirs stays
        if self._previous is _ABSENT:
            vars(obj).pop(self._name, None)
        else:
            setattr(obj, self._name, self._previous)


class ItemPatch:
    """``mapping[key] = value`` at construction; :meth:`undo` restores the
    previous value, or removes the entry if there was none."""

    def __init__(self, mapping: MutableMapping[str, Any], key: str, value: Any) -> None:
        self._mapping: MutableMapping[str, Any] | None = mapping
        self._key = key
        self._previous = mapping.get(key, _ABSENT)
        self._value = value
        mapping[key] = value

    def undo(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is None or mapping.get(self._key, _ABSENT) != self._value:
            return  # undone already, or replaced after us: theirs stays
        if self._previous is _ABSENT:
            mapping.pop(self._key, None)
        else:
            mapping[self._key] = self._previous
