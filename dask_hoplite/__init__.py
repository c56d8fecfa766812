"""dask-hoplite: large-object communication in Dask as fast as the network allows.

Register the plugin once per cluster::

    client.register_plugin(dask_hoplite.Hoplite())

or start the scheduler with ``dask scheduler --preload dask_hoplite``. Large keys
(``hoplite.min-bytes``, default 1 MiB) that workers fetch from peers then travel
as pipelined block streams along trees that a directory on the scheduler forms
as receivers arrive (after Hoplite, Zhuang et al., SIGCOMM 2021).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dask_hoplite import config as _config  # noqa: F401  (loads the defaults)
from dask_hoplite._version import __version__
from dask_hoplite.collectives import (
    allgather,
    allreduce,
    broadcast,
    gather,
    reduce,
    reduced_inputs,
)
from dask_hoplite.scheduler.plugin import Hoplite
from dask_hoplite.worker.plugin import HopliteWorker

if TYPE_CHECKING:
    from distributed import Scheduler

__all__ = [
    "Hoplite",
    "HopliteWorker",
    "__version__",
    "allgather",
    "allreduce",
    "broadcast",
    "dask_setup",
    "gather",
    "reduce",
    "reduced_inputs",
]


def dask_setup(scheduler: Scheduler) -> None:
    """Entry point of ``dask scheduler --preload dask_hoplite``."""
    scheduler.add_plugin(Hoplite())
