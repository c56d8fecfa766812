"""How many parts :func:`dask_hoplite.broadcast` cuts an object into, decided
on the scheduler (RPC ``hoplite_broadcast_parts``) when ``parts`` is "auto".

The answer waits for the object to be in memory (its size decides as much
as the number of hosts), then asks
:func:`~dask_hoplite.core.shape_choice.choose_parts` with the hosts of the
receivers and of one holder, the object's size and the network model's
estimate. Objects under ``min-bytes`` travel on Dask's own path: one part.
"""

from __future__ import annotations

import logging
from typing import Any

from dask.typing import Key

from dask_hoplite.core.hosts import host_of
from dask_hoplite.core.network_model import NetworkEstimate
from dask_hoplite.core.reduce_plan import is_small
from dask_hoplite.core.shape_choice import choose_parts
from dask_hoplite.scheduler.first_ready import FirstReady

logger = logging.getLogger(__name__)


class BroadcastShape:
    """The RPC ``hoplite_broadcast_parts``, waiting with ``first_ready``."""

    def __init__(self, first_ready: FirstReady) -> None:
        self.first_ready = first_ready

    async def parts(
        self, key: Key, receivers: list[str], min_bytes: int, block_bytes: int
    ) -> dict[str, Any]:
        """``{"parts", "nbytes", "hosts"}`` for a broadcast of ``key`` to
        ``receivers`` once ``key`` is in memory; ``{"parts": 1}`` if it
        cannot come back (the broadcast's tasks then report its error)."""
        m = await self.first_ready.first_ready([key], 1)
        if "failed" in m:
            return {"parts": 1, "nbytes": None, "hosts": None}
        nbytes = int(m["nbytes"][key])
        holders = m["who_has"][key]
        hosts = {host_of(a) for a in receivers} | {host_of(a) for a in holders[:1]}
        net = NetworkEstimate.from_msg(m["network"])
        if is_small(nbytes, min_bytes):
            parts = 1
        else:
            parts = choose_parts(
                "broadcast", len(hosts), nbytes, net.bandwidth, net.latency, block_bytes
            )
        logger.debug("broadcast of %r to %d hosts: %d parts", key, len(hosts), parts)
        return {"parts": parts, "nbytes": nbytes, "hosts": len(hosts)}
