"""Run the aggregates of dask.array reductions and dask.bag folds as pipelined
hoplite reductions, without the user changing their code.

A submitted graph reaches ``Scheduler._create_taskstate_from_graph`` after all
client- and scheduler-side optimisation and before any task state exists: the
last point where the graph is plain data. This override rewrites it there with
:func:`dask_hoplite.graph_reductions.rewrite.rewrite_graph` (which decides what is an
aggregate worth rewriting) and then calls Dask's own method. A graph the
rewrite fails on runs as submitted. Installed only when
``hoplite.array.reductions`` or ``hoplite.bag.reductions`` is on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dask_hoplite.config import HopliteConfig
from dask_hoplite.graph_reductions.rewrite import rewrite_graph
from dask_hoplite.patching import AttributePatch

if TYPE_CHECKING:
    from distributed import Scheduler

logger = logging.getLogger(__name__)


class GraphRewrite:
    """``Scheduler._create_taskstate_from_graph`` with aggregates rewritten."""

    def __init__(self, config: HopliteConfig) -> None:
        self.config = config
        self._original: Callable[..., Any] | None = None
        self._patch: AttributePatch | None = None

    def install(self, scheduler: Scheduler) -> None:
        if self._patch is not None:
            return
        self._original = scheduler._create_taskstate_from_graph
        self._patch = AttributePatch(
            scheduler, "_create_taskstate_from_graph", self._create_taskstate_from_graph
        )

    def restore(self) -> None:
        patch, self._patch = self._patch, None
        if patch is not None:
            patch.undo()

    def _create_taskstate_from_graph(self, **kwargs: Any) -> Any:
        """The scheduler's entry point for a submitted graph (after all
        optimisation, before any task state exists), with the aggregates of
        dask.array reductions and dask.bag folds rewritten into pipelined
        reductions (see :mod:`dask_hoplite.graph_reductions.rewrite`)."""
        assert self._original is not None
        try:
            dsk, n = rewrite_graph(
                kwargs["dsk"],
                kwargs["keys"],
                self.config.array_max_inputs,
                arrays=self.config.array_reductions,
                bags=self.config.bag_reductions,
            )
        except Exception:
            logger.exception("hoplite could not rewrite a graph; running it as submitted")
        else:
            if n:
                logger.debug("%d array/bag aggregates run as hoplite reductions", n)
                kwargs["dsk"] = dsk
                # A task taken out of a fused one is ordered with its dependent.
                ordered = kwargs.get("ordered")
                if ordered:
                    for k, t in dsk.items():
                        for d in getattr(t, "dependencies", ()):
                            if d not in ordered and k in ordered:
                                ordered[d] = ordered[k]
        return self._original(**kwargs)
