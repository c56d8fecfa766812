"""What workers and clients ask the scheduler part, beyond Dask's own RPCs.

Thin coroutines over an RPC handle to the scheduler (``worker.scheduler`` or
``client.scheduler``), each returning plain data: the network estimate reduce
trees are planned with, where keys are and how big, and a wait for the holders
of keys that Dask is recomputing from their lineage.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_hoplite.config import HopliteConfig
from dask_hoplite.core.network_model import NetworkEstimate, NetworkModel

logger = logging.getLogger(__name__)


async def network_estimate(scheduler: Any) -> NetworkEstimate:
    """The scheduler part's estimate (``scheduler``: an RPC handle to it); the
    configured values or the fallbacks if it cannot be asked."""
    try:
        return NetworkEstimate.from_msg(await scheduler.hoplite_network())
    except Exception as e:  # the plugin is missing or the scheduler is unreachable
        logger.debug("network estimate unavailable (%s); using configured values", e)
        cfg = HopliteConfig.from_dask_config()
        return NetworkModel(cfg.reduce_bandwidth, cfg.reduce_latency).estimate()
