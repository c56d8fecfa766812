"""The sans-IO core of dask-hoplite: plain classes and functions driven by
events, returning decisions, with no sockets and no event loop inside.

* :mod:`~dask_hoplite.core.directory`: who holds which key, who streams from whom;
* :mod:`~dask_hoplite.core.hosts`: which host a worker runs on;
* :mod:`~dask_hoplite.core.measured_sizes`: objects whose ``sizeof`` Dask gets wrong,
  and the serialised sizes measured instead;
* :mod:`~dask_hoplite.core.split_trees`: a split-tree broadcast's trees, one per part;
* :mod:`~dask_hoplite.core.byte_ranges`: a key received in byte ranges, one tree each;
* :mod:`~dask_hoplite.core.object_parts`: cutting an object into parts and joining them;
* :mod:`~dask_hoplite.core.tree_shape`: the shape of a reduce tree;
* :mod:`~dask_hoplite.core.shape_choice`: one tree or split trees, and how many parts;
* :mod:`~dask_hoplite.core.block_size`: the block a stream reads, fitted to its chain's depth;
* :mod:`~dask_hoplite.core.relay_rates`: streams' receive rates, and the relays that
  hold a chain back;
* :mod:`~dask_hoplite.core.reduce_plan`: how one reduction runs once its inputs are ready;
* :mod:`~dask_hoplite.core.allreduce_outputs`: an allreduce's outputs, one per input:
  which worker makes each and how (root, copy, part, pull, alias);
* :mod:`~dask_hoplite.core.reduce_spec`: a reduce tree as data, and input checks;
* :mod:`~dask_hoplite.core.pytrees`: models (dicts, lists, tuples of arrays) as one flat array;
* :mod:`~dask_hoplite.core.reduce_ops`: the operators and their dtypes;
* :mod:`~dask_hoplite.core.tree_repair`: the repair state machine of a running tree;
* :mod:`~dask_hoplite.core.tree_spread`: spreading a dead node over the live ones;
* :mod:`~dask_hoplite.core.protocol`: the block-stream messages and flow-control window;
* :mod:`~dask_hoplite.core.store`: the block store's buffers;
* :mod:`~dask_hoplite.core.buffer_pool`: recycled receive memory;
* :mod:`~dask_hoplite.core.network_model`: bandwidth and latency estimates.

The pure halves of graph reductions (recognising dask.array/bag aggregates
and rewriting them) live with their scheduler and worker sides in
:mod:`dask_hoplite.graph_reductions`.

``tests/test_module_maps.py`` checks that this list names every module here.

None of these modules imports asyncio, tornado or distributed, nor any
dask_hoplite module outside this package except :mod:`dask_hoplite.errors`
(``tests/test_structure.py`` enforces it).
"""
