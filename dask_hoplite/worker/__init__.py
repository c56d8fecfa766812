"""The worker part of dask-hoplite: one module per job.

* :mod:`~dask_hoplite.worker.plugin`: the ``WorkerPlugin`` (lifecycle, handler table, routing);
* :mod:`~dask_hoplite.worker.context`: what the components share;
* :mod:`~dask_hoplite.worker.receiver`: fetch with resume, and Dask's fetch paths over it;
* :mod:`~dask_hoplite.worker.sender`: the ``hoplite_stream`` peer handler;
* :mod:`~dask_hoplite.worker.partial_copies`: a copy's fate when Dask's state of its key changes;
* :mod:`~dask_hoplite.worker.reductions`: the reduce trees this worker takes part in;
* :mod:`~dask_hoplite.worker.reduce_node` / :mod:`~dask_hoplite.worker.combine`: a node of a tree;
* :mod:`~dask_hoplite.worker.reduce_root`: a tree's root (one object per running tree);
* :mod:`~dask_hoplite.worker.allreduce` / :mod:`~dask_hoplite.worker.small_allreduce`;
* :mod:`~dask_hoplite.worker.aggregate`: dask.array/bag aggregates as reduce trees;
* :mod:`~dask_hoplite.worker.tasks`: the functions the collectives submit as Dask tasks.
"""

from dask_hoplite.worker.context import PLUGIN_NAME
from dask_hoplite.worker.plugin import HopliteWorker

__all__ = ["PLUGIN_NAME", "HopliteWorker"]
