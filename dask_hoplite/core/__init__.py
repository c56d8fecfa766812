"""The sans-IO core of dask-hoplite: plain classes and functions driven by
events, returning decisions, with no sockets and no event loop inside.

* :mod:`~dask_hoplite.core.directory`: who holds which key, who streams from whom;
* :mod:`~dask_hoplite.core.planner`: the shape of a reduce tree;
* :mod:`~dask_hoplite.core.tree_repair`: a running tree's replacements of dead nodes;
* :mod:`~dask_hoplite.core.reduce_spec`: a reduce tree as data, and input checks;
* :mod:`~dask_hoplite.core.reduce_ops`: the operators and their dtypes;
* :mod:`~dask_hoplite.core.protocol`: the block-stream messages and flow-control window;
* :mod:`~dask_hoplite.core.store`: the block store's buffers and memory pool;
* :mod:`~dask_hoplite.core.network_model`: bandwidth and latency estimates;
* :mod:`~dask_hoplite.core.graph_reduce`: the dask.array/bag aggregate rewrite.

None of these modules imports asyncio, tornado or distributed, nor any
dask_hoplite module outside this package except :mod:`dask_hoplite.errors`
(``tests/test_structure.py`` enforces it).
"""
