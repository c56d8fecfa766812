"""Which host a worker runs on, from its comm address.

Several Dask workers often share one machine, and so one NIC. The object
directory plans per host with this (a key enters a host once over the network;
senders on the receiver's own host come first; the fan-out limit counts per
NIC), and the reduce planner keeps the inputs of one host together.
"""

from __future__ import annotations


def host_of(address: str) -> str:
    """The host part of a comm address (``tcp://10.0.0.1:8786`` -> ``10.0.0.1``,
    ``tcp://[::1]:8786`` -> ``::1``), as Dask's ``get_address_host``."""
    scheme, _, loc = address.rpartition("://")
    if scheme == "inproc":  # inproc://10.0.0.1/<pid>/<n>
        return loc.split("/", 1)[0]
    if loc.startswith("["):
        return loc[1 : loc.index("]")]
    return loc.rsplit(":", 1)[0] if ":" in loc else loc
