"""The scheduler part's Prometheus series (on the scheduler's ``/metrics``).

With Dask's default namespace their names start with ``dask_hoplite_scheduler_``;
each has the label ``scheduler`` (its address: a process may run several):

``directory_entries``
    keys the object directory tracks (with complete or partial copies)
``transfers_active``
    streams the directory has assigned that have not finished
``requests_waiting``
    requests parked until a sender frees up
``requests_total{answer}``
    the directory's answers: ``assign``, ``missing``, ``small``, ``error``
``transfers_total{outcome}``
    streams that finished, ``ok`` or ``failed``
``bytes_streamed_total``
    bytes of the streams that finished ok
``collectives_total{kind, outcome}``
    reduce trees that ended (``reduce``/``allreduce``; ``ok``, ``restarted``,
    ``failed`` as their roots report them)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dask_hoplite.prometheus import SeriesCollector, counter, gauge
from dask_hoplite.scheduler.collective_log import CollectiveLog
from dask_hoplite.scheduler.directory_service import DirectoryService


@dataclass(frozen=True, eq=False)
class SchedulerSource:
    """What the scheduler's series are read from."""

    address: Callable[[], str]
    service: DirectoryService
    collectives: CollectiveLog


def scheduler_families(
    name: Callable[[str], str], sources: Iterable[SchedulerSource]
) -> Iterator[Any]:
    sources = list(sources)
    s = ["scheduler"]
    entries = gauge(name("directory_entries"), "Keys the object directory tracks", s)
    active = gauge(name("transfers_active"), "Assigned streams not finished", s)
    waiting = gauge(name("requests_waiting"), "Requests waiting for a sender", s)
    answers = counter(name("requests"), "The directory's answers to requests", [*s, "answer"])
    finished = counter(name("transfers"), "Streams that finished", [*s, "outcome"])
    streamed = counter(name("bytes_streamed"), "Bytes of the streams that finished ok", s)
    collectives = counter(name("collectives"), "Reduce trees that ended", [*s, "kind", "outcome"])
    for src in sources:
        a = src.address()
        d = src.service.directory
        entries.add_metric([a], len(d))
        active.add_metric([a], len(d.transfers))
        waiting.add_metric([a], len(src.service.waiting))
        for answer in ("assign", "missing", "small", "error"):
            answers.add_metric([a, answer], src.service.answers.get(answer, 0))
        for outcome in ("ok", "failed"):
            finished.add_metric([a, outcome], src.service.transfers_finished.get(outcome, 0))
        streamed.add_metric([a], src.service.bytes_streamed)
        for (kind, outcome), n in sorted(src.collectives.counts.items()):
            collectives.add_metric([a, kind, outcome], n)
    yield from (entries, active, waiting, answers, finished, streamed, collectives)


#: The scheduler part of this process, as one Prometheus collector.
SCHEDULER_SERIES: SeriesCollector[SchedulerSource] = SeriesCollector(
    "scheduler", scheduler_families
)
