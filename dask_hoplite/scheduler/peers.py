"""Which workers run which of dask-hoplite's features.

A worker reports its features when its part starts (RPC
``hoplite_worker_features``). Until then, and for good if its part never
starts (another dask-hoplite version, a transport that drifted there), it is
an outsider: the directory never hands it out as a sender, and whatever it
needs travels Dask's way. A feature runs cluster-wide (:meth:`Peers.everywhere`)
only where the scheduler and every worker run it; the collectives ask that
before they plan a tree (through the scheduler's metadata, see
:mod:`dask_hoplite.scheduler_calls`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from dask_hoplite.features import TRANSPORT, FeatureSet

logger = logging.getLogger(__name__)


class Peers:
    """The feature table of the cluster's workers.

    ``features``: the scheduler's own. ``outsider``: called with an address
    and whether it is an outsider now (the directory's exclusion list).
    ``changed``: called after any change (the plugin republishes what runs
    cluster-wide)."""

    def __init__(
        self,
        features: FeatureSet,
        outsider: Callable[[str, bool], None],
        changed: Callable[[], None],
    ) -> None:
        self.features = features
        self._outsider = outsider
        self._changed = changed
        #: Features on, by worker; None: the worker has not reported (yet).
        self.workers: dict[str, frozenset[str] | None] = {}
        #: Why a feature is off on a worker, by worker (as it reported).
        self.off: dict[str, dict[str, str]] = {}

    def joined(self, addresses: Iterable[str]) -> None:
        """Workers whose part has not reported yet: outsiders until it does."""
        for a in addresses:
            self.workers.setdefault(a, None)
            self._outsider(a, True)
        self._changed()

    def reported(self, address: str, on: Iterable[str], off: dict[str, str] | None = None) -> None:
        """RPC ``hoplite_worker_features``: the features running on ``address``."""
        features = frozenset(on) & self.features.on
        self.workers[address] = features
        self.off[address] = dict(off or {})
        self._outsider(address, TRANSPORT not in features)
        if off:
            logger.info("worker %s runs dask-hoplite without %s", address, ", ".join(sorted(off)))
        self._changed()

    def left(self, address: str) -> None:
        self.workers.pop(address, None)
        self.off.pop(address, None)
        self._outsider(address, False)
        self._changed()

    def everywhere(self, feature: str) -> bool:
        """Whether the scheduler and every worker run ``feature``."""
        return feature in self.features and all(
            f is not None and feature in f for f in self.workers.values()
        )

    def to_msg(self) -> dict[str, Any]:
        return {
            "scheduler": self.features.to_msg(),
            "workers": {
                a: None if f is None else sorted(f) for a, f in sorted(self.workers.items())
            },
            "workers_off": {a: o for a, o in sorted(self.off.items()) if o},
        }
