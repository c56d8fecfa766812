"""Which inputs a reduction's result holds, when spares replaced lost ones.

With ``k < n``, the root of a reduce tree whose node died with its input
restarts the tree with a ready spare in the lost input's place
(:func:`~dask_hoplite.core.reduce_spec.with_spares`). The plan's choice is then
no longer what the result holds: the root tells the scheduler part which input
replaced which (``hoplite_spares_used``, under the result task's key), and
:func:`dask_hoplite.reduced_inputs` asks (``hoplite_reduced_inputs``) once the
result is there. A record lives as long as its result key: it goes when Dask
forgets the key.
"""

from __future__ import annotations

from typing import Any

from dask.typing import Key


class SparesUsed:
    """lost input -> the spare that replaced it, per reduction result key."""

    def __init__(self) -> None:
        self.swaps: dict[Key, dict[Key, Key]] = {}

    def used(self, key: Key, swaps: list[list[Any]]) -> None:
        """RPC ``hoplite_spares_used``: in result ``key``, each ``[lost,
        spare]`` pair's spare replaced its lost input."""
        record = self.swaps.setdefault(_key(key), {})
        for lost, spare in swaps:
            record[_key(lost)] = _key(spare)

    def reduced_inputs(self, key: Key) -> list[list[Any]]:
        """RPC ``hoplite_reduced_inputs``: the ``[lost, spare]`` pairs of
        result ``key`` (none: the plan's choice is what it holds)."""
        return [[lost, spare] for lost, spare in self.swaps.get(_key(key), {}).items()]

    def key_transitioned(self, key: Key, finish: str) -> None:
        if finish == "forgotten":
            self.swaps.pop(key, None)


def _key(key: Any) -> Key:
    """A key as it arrived in a message (a tuple key comes as a list)."""
    return tuple(_key(k) for k in key) if isinstance(key, list) else key
