"""The split-tree path of :func:`dask_hoplite.broadcast` (``parts`` above 1).

The object is cut where it is into ``parts`` keys
(:mod:`dask_hoplite.core.object_parts`), a task tells the scheduler's
directory that they are the parts of one broadcast to the given workers (it
plans one tree per part, :mod:`dask_hoplite.core.split_trees`; without
dask-hoplite the task does nothing), and a task on every worker joins the
parts, which Dask fetches through hoplite's streams.
"""

from __future__ import annotations

from distributed import Client, Future

from dask_hoplite.worker import tasks


def split_broadcast(client: Client, f: Future, workers: list[str], parts: int) -> list[Future]:
    """Cut ``f`` where it is, announce the parts' trees to the directory (a
    task, so that nothing here waits), then join the parts on every worker
    once the announcement is made."""
    flat = client.submit(tasks.split_flat, f, pure=False)
    meta = client.submit(tasks.split_meta, f, pure=False)
    cut = [client.submit(tasks.split_part, flat, j, parts, pure=False) for j in range(parts)]
    announced = client.submit(tasks.announce_split, [p.key for p in cut], list(workers), pure=False)
    return [
        client.submit(
            tasks.join_split_parts,
            announced,
            meta,
            *cut,
            workers=[w],
            allow_other_workers=False,
            pure=False,
        )
        for w in workers
    ]
