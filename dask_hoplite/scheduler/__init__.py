"""The scheduler part of dask-hoplite.

:class:`Hoplite` (:mod:`.plugin`) is the ``SchedulerPlugin`` users register; it
only wires the rest into the scheduler and takes it out again:

- :mod:`.directory_service`: the RPC shell around the sans-IO object directory
  (workers ask it whom to stream a large key from and report their transfers);
- :mod:`.measured_sizes`: keys a worker measured larger than Dask's ``sizeof``,
  and telling the workers whose tasks need them;
- :mod:`.queries`: read-only RPCs reductions and collectives plan with;
- :mod:`.reduction_coordinator`: every reduction run's plan, made here (a
  reduce, an allreduce, a graph aggregate, a fallback, a broken tree's restart);
- :mod:`.first_ready`: the first ``k`` of a reduction's inputs to be ready;
- :mod:`.gc_paused`: no garbage collection while the loop plans (its
  temporaries die young instead of bringing a full collection closer);
- :mod:`.spares_used`: which inputs a result holds when spares replaced lost ones;
- :mod:`.cancellation`: a collective task cancelled while it runs is stopped on its worker;
- :mod:`.collective_log`: what the collectives did, by kind and outcome;
- :mod:`.metrics`: the scheduler part's Prometheus series;
- :mod:`.peers`: which workers run which features (an outsider never sends);
- :mod:`.prompt_stealing`: a task needing a large key, queued behind a busy
  thread, moves to an idle worker at once (Dask's steal, sooner);
- :mod:`.replicate`, :mod:`.amm`: one override of a Dask internal each
  (``replicate``, the Active Memory Manager's ``_find_dropper``), each undone
  exactly by its ``restore`` (with :mod:`dask_hoplite.patching`); the graph
  entry point's override is in :mod:`dask_hoplite.graph_reductions`.

``tests/test_module_maps.py`` checks that this list names every module here.
"""
