"""The scheduler part of dask-hoplite.

:class:`Hoplite` (:mod:`.plugin`) is the ``SchedulerPlugin`` users register; it
only wires the rest into the scheduler and takes it out again:

- :mod:`.directory_service`: the RPC shell around the sans-IO object directory
  (workers ask it whom to stream a large key from and report their transfers);
- :mod:`.queries`: read-only RPCs reductions and collectives plan with;
- :mod:`.replicate`, :mod:`.graph_rewrite`, :mod:`.amm`: one override of a Dask
  internal each (``replicate``, ``_create_taskstate_from_graph``, the Active
  Memory Manager's ``_find_dropper``), each undone exactly by its ``restore``
  (with :mod:`.patching`).
"""

from __future__ import annotations

from dask_hoplite.scheduler.plugin import Hoplite

__all__ = ["Hoplite"]
