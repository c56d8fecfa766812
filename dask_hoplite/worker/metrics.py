"""The worker part's Prometheus series (on each worker's ``/metrics``).

Every series has the label ``worker`` (the worker's address). With Dask's
default namespace their names start with ``dask_hoplite_worker_``:

Counters, since the plugin started on the worker:

``bytes_received_total``
    bytes streamed into this worker (keys, reduce partial results, allreduce copies)
``bytes_sent_total``
    bytes this worker streamed to peers
``keys_received_total``
    keys fetched through hoplite
``local_hits_total``
    fetches served from a complete copy already on this worker
``resumes_total``
    streams resumed from the byte reached, with another sender
``restarts_total``
    fetches restarted from byte 0 (the object had changed) and reduce trees
    restarted with their inputs located again
``tree_repairs_total``
    reduce-tree nodes replaced or spread while the tree ran
``fallbacks_total{path}``
    work handed to Dask's own path: ``fetch`` (a key hoplite could not
    fetch), ``allreduce``, ``graph-reduction`` (an array/bag aggregate)
``streams_failed_total{direction}``
    streams that broke: ``in`` (resumed elsewhere), ``out`` (aborted)
``requests_refused_total``
    stream requests this worker refused (no copy, bad request)
``collectives_total{kind, outcome}``
    reduce trees rooted here: ``kind`` ``reduce`` / ``allreduce``;
    ``outcome`` ``ok``, ``restarted`` (finished after a restart) or ``failed``

Gauges:

``streams_active{direction}``
    streams running now, into (``in``) and out of (``out``) this worker
``store_keys``
    objects in the block store (complete or filling)
``buffer_pool_bytes{state}``
    ``in_use``: bytes of the block store's buffers; ``idle``: pooled memory
    kept for reuse (``hoplite.buffer-pool-bytes``)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from dask_hoplite.prometheus import SeriesCollector, counter, gauge
from dask_hoplite.worker.context import WorkerContext

#: ``series -> (help, [stats counted in it])``: counters without labels.
_COUNTERS: dict[str, tuple[str, list[str]]] = {
    "bytes_received": ("Bytes streamed into this worker by hoplite", ["bytes-received"]),
    "bytes_sent": ("Bytes this worker streamed to peers through hoplite", ["bytes-sent"]),
    "keys_received": ("Keys fetched through hoplite", ["keys-received"]),
    "local_hits": ("Fetches served from a complete copy on this worker", ["local-hits"]),
    "resumes": ("Streams resumed from the byte reached with another sender", ["resumes"]),
    "restarts": (
        "Fetches restarted from byte 0 and reduce trees restarted",
        ["restarts", "reduce-restarts"],
    ),
    "tree_repairs": (
        "Reduce-tree nodes replaced or spread while the tree ran",
        ["reduce-repairs", "reduce-children-replaced", "reduce-children-spread"],
    ),
    "requests_refused": ("Stream requests this worker refused", ["requests-refused"]),
}

#: ``label -> stat`` of ``fallbacks_total{path}``.
_FALLBACKS = {
    "fetch": "fallbacks",
    "allreduce": "allreduce-fallbacks",
    "graph-reduction": "graph-reduction-fallbacks",
}


def worker_families(name: Callable[[str], str], contexts: Iterable[WorkerContext]) -> Iterator[Any]:
    contexts = list(contexts)
    for series, (doc, stats) in _COUNTERS.items():
        family = counter(name(series), doc, ["worker"])
        for ctx in contexts:
            family.add_metric([ctx.address], sum(ctx.stats.get(s, 0) for s in stats))
        yield family

    fallbacks = counter(name("fallbacks"), "Work handed to Dask's own path", ["worker", "path"])
    failed = counter(name("streams_failed"), "Streams that broke", ["worker", "direction"])
    collectives = counter(
        name("collectives"), "Reduce trees rooted on this worker", ["worker", "kind", "outcome"]
    )
    active = gauge(name("streams_active"), "Streams running now", ["worker", "direction"])
    keys = gauge(name("store_keys"), "Objects in the block store", ["worker"])
    pool = gauge(name("buffer_pool_bytes"), "Buffer memory, in use or idle", ["worker", "state"])
    for ctx in contexts:
        a = ctx.address
        for label, stat in _FALLBACKS.items():
            fallbacks.add_metric([a, label], ctx.stats.get(stat, 0))
        failed.add_metric([a, "in"], ctx.stats.get("streams-failed", 0))
        failed.add_metric([a, "out"], ctx.stats.get("streams-aborted", 0))
        for (kind, outcome), n in sorted(ctx.collectives.items()):
            collectives.add_metric([a, kind, outcome], n)
        active.add_metric([a, "in"], len(ctx.incoming))
        active.add_metric([a, "out"], ctx.outgoing)
        keys.add_metric([a], len(ctx.store))
        pool.add_metric([a, "in_use"], ctx.store.nbytes)
        pool.add_metric([a, "idle"], ctx.store.pool.idle_bytes)
    yield from (fallbacks, failed, collectives, active, keys, pool)


#: The worker parts of this process, as one Prometheus collector.
WORKER_SERIES: SeriesCollector[WorkerContext] = SeriesCollector("worker", worker_families)
