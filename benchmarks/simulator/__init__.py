"""A flow-level discrete-event simulator of hoplite's broadcast and reduce that
drives the real sans-IO cores (the object directory, the reduce planner, tree
repair), to see how they behave where the emulated cluster cannot go.

* :mod:`~benchmarks.simulator.network`: hosts with full-duplex NICs, max-min
  fair rates, pipelined flows that never overtake their sender;
* :mod:`~benchmarks.simulator.engine`: the event loop;
* :mod:`~benchmarks.simulator.params`: the cluster and its calibrated overheads;
* :mod:`~benchmarks.simulator.broadcast` and :mod:`~benchmarks.simulator.reduce`:
  the collectives (and Dask's defaults for comparison);
* :mod:`~benchmarks.simulator.calibrate`: fitting the overheads to measurements.

``benchmarks/simulate.py`` is the command line.
"""
