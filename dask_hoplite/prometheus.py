"""dask-hoplite's Prometheus series, served on Dask's own ``/metrics`` pages.

Dask's scheduler and workers serve ``prometheus_client``'s process-wide
registry at ``/metrics``. Each part of dask-hoplite adds its series there
while its plugin runs: :class:`SeriesCollector` is one registered collector
per kind of source ("scheduler", "worker") that yields the series of every
live source of that kind in this process (several workers share a process in
``LocalCluster(processes=False)``; each worker's series carry its address as
the ``worker`` label). The collector is registered when the first source is
added and unregistered when the last one is removed, so a plugin that stops
leaves nothing behind.

Series are named ``<namespace>_hoplite_<side>_<name>``, with Dask's
``distributed.dashboard.prometheus.namespace`` (default ``dask``): e.g.
``dask_hoplite_worker_bytes_received_total``. Which series each side has is
defined, and documented, next to what they measure:
:mod:`dask_hoplite.worker.metrics` and :mod:`dask_hoplite.scheduler.metrics`.

Without ``prometheus_client`` installed (Dask's pages then say metrics are not
available) nothing is registered.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import dask.config

logger = logging.getLogger(__name__)

S = TypeVar("S")

#: ``(build_name, sources) -> metric families``: one side's series.
Families = Callable[[Callable[[str], str], list[Any]], Iterable[Any]]


def series_prefix(side: str) -> str:
    namespace = dask.config.get("distributed.dashboard.prometheus.namespace", "dask")
    return "_".join(p for p in (namespace, "hoplite", side) if p)


class SeriesCollector(Generic[S]):
    """The series of every live source of one side, as one Prometheus collector."""

    def __init__(self, side: str, families: Families) -> None:
        self.side = side
        self.families = families
        self.sources: list[S] = []
        self._lock = threading.Lock()
        self.registered = False

    def build_name(self, name: str) -> str:
        return f"{series_prefix(self.side)}_{name}"

    def collect(self) -> Iterator[Any]:
        with self._lock:
            sources = list(self.sources)
        if sources:
            yield from self.families(self.build_name, sources)

    def add(self, source: S) -> None:
        """Export ``source``'s series (registers the collector with the first)."""
        with self._lock:
            self.sources.append(source)
            first = not self.registered
            self.registered = True
        if first:
            registry = _registry()
            if registry is None:
                return
            try:
                registry.register(self)
            except ValueError as e:  # a name clash: report, never break the plugin
                logger.warning("hoplite's %s metrics not exported: %s", self.side, e)

    def remove(self, source: S) -> None:
        """Stop exporting ``source`` (unregisters the collector with the last)."""
        with self._lock:
            if source in self.sources:
                self.sources.remove(source)
            last = self.registered and not self.sources
            if last:
                self.registered = False
        if last:
            registry = _registry()
            if registry is not None:
                try:
                    registry.unregister(self)
                except KeyError:
                    pass


def _registry() -> Any:
    try:
        import prometheus_client
    except ImportError:
        return None
    return prometheus_client.REGISTRY


def counter(name: str, doc: str, labels: list[str]) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, labels=labels)


def gauge(name: str, doc: str, labels: list[str]) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, doc, labels=labels)
