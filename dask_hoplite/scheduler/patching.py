"""Reversible replacements of Dask internals on a live scheduler.

Each override of the scheduler part (:mod:`.replicate`, :mod:`.graph_rewrite`,
:mod:`.amm`) replaces an attribute or a handler entry of an object it does not
own. Undoing that by hand invites subtle differences (setting back a bound
method as an instance attribute, removing an entry that was never ours); the
two records here remember exactly what was there and put back exactly that,
once. :class:`Override` is the shape the plugin expects of each override.
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
        setattr(obj, name, value)

    def undo(self) -> None:
        obj, self._obj = self._obj, None
        if obj is None:
            return
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
        mapping[key] = value

    def undo(self) -> None:
        mapping, self._mapping = self._mapping, None
        if mapping is None:
            return
        if self._previous is _ABSENT:
            mapping.pop(self._key, None)
        else:
            mapping[self._key] = self._previous
