"""dask.array reductions and dask.bag folds run as pipelined reduce trees,
without the user changing their code: one package for the whole path, from
the graph the client submits to the tree on the workers.

* :mod:`~dask_hoplite.graph_reductions.recognize`: which tasks of a graph are
  the aggregates of an array reduction or a bag fold (pure);
* :mod:`~dask_hoplite.graph_reductions.rewrite`: the graph with those
  aggregates rewritten into one ``GraphReduce`` task per reduction (pure);
* :mod:`~dask_hoplite.graph_reductions.scheduler_hook`: the scheduler's graph
  entry point, overridden to apply the rewrite;
* :mod:`~dask_hoplite.graph_reductions.worker_takeover`: a worker that gets a
  rewritten task reduces the parts where they live, with a tree the
  scheduler's coordinator plans.

``tests/test_module_maps.py`` checks that this list names every module here.
"""
