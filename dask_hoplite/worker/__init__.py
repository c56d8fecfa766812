"""The worker part of dask-hoplite: one module per job.

* :mod:`~dask_hoplite.worker.plugin`: the ``WorkerPlugin`` (lifecycle, handler table, routing);
* :mod:`~dask_hoplite.worker.context`: what the components share;
* :mod:`~dask_hoplite.worker.receiver`: fetch with resume;
* :mod:`~dask_hoplite.worker.fetch_paths`: Dask's fetch paths (``gather_dep``, ``gather``) over it;
* :mod:`~dask_hoplite.worker.sender`: the ``hoplite_stream`` peer handler;
* :mod:`~dask_hoplite.worker.streams`: the sender and receiver loops over ``distributed.comm``;
* :mod:`~dask_hoplite.worker.partial_copies`: a copy's fate when Dask's state of its key changes;
* :mod:`~dask_hoplite.worker.measuring`: results Dask cannot size, serialised once and
  measured when their task finishes;
* :mod:`~dask_hoplite.worker.prefault`: receive memory faulted in off the critical path;
* :mod:`~dask_hoplite.worker.memfd_regions`: an object's bytes in sealed memfd memory that
  the workers of one host map, each task through a private copy-on-write view (issue 42);
* :mod:`~dask_hoplite.worker.region_handoff`: such a region handed to another worker of the
  host over a Unix socket (``SCM_RIGHTS``), not copied (issue 42);
* :mod:`~dask_hoplite.worker.host_sharing`: one copy per host: large keys received into
  such regions, and taken from another worker of the host by mapping its region;
* :mod:`~dask_hoplite.worker.shared_pages`: the worker's memory for Dask's spill and pause,
  pages shared with the host's other workers counted at their share;
* :mod:`~dask_hoplite.worker.nanny_memory`: the same reading for the nanny's terminate
  threshold (a nanny plugin);
* :mod:`~dask_hoplite.worker.accounting`: hoplite's transfers in Dask's own bookkeeping;
* :mod:`~dask_hoplite.worker.progress`: incoming streams' progress, in the heartbeat;
* :mod:`~dask_hoplite.worker.timelines`: per-key timelines of fetches (``hoplite.timelines``);
* :mod:`~dask_hoplite.worker.metrics`: the worker's Prometheus series;
* :mod:`~dask_hoplite.worker.reductions`: the reduce trees this worker takes part in;
* :mod:`~dask_hoplite.worker.reduce_node` / :mod:`~dask_hoplite.worker.combine`: a node of a tree;
* :mod:`~dask_hoplite.worker.reduce_root`: a tree's root (one object per running tree);
* :mod:`~dask_hoplite.worker.tree_spreader`: the root's side of spreading a dead node;
* :mod:`~dask_hoplite.worker.planned_reduce`: ``reduce``'s planning task and result task;
* :mod:`~dask_hoplite.worker.running_tasks`: the collectives' coroutine tasks by key, stopped
  when the scheduler part says their key was cancelled;
* :mod:`~dask_hoplite.worker.planned_outputs`: ``allreduce``'s and ``allgather``'s
  planning task (places one output per input on its worker) and output tasks;
* :mod:`~dask_hoplite.worker.allreduce` / :mod:`~dask_hoplite.worker.small_allreduce`;
* :mod:`~dask_hoplite.worker.tasks`: the functions the collectives submit as Dask tasks.

``tests/test_module_maps.py`` checks that this list names every module here.
"""
