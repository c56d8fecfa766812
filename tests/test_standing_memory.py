"""By default the plugin costs a worker that moves no large object no standing
memory (``hoplite.buffer-pool-reserve`` is 0); a reserve is there when asked
for, and costs what it says."""

from __future__ import annotations

import gc
import os

import dask
import psutil
import yaml
from distributed import Client, LocalCluster

import dask_hoplite as dh

MiB = 2**20


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _rss_before_and_after_the_plugin(config: dict) -> tuple[int, int]:
    """One worker process of 4 GiB: its resident memory before the plugin is
    registered and once its setup has returned."""
    with (
        dask.config.set(config),
        LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            memory_limit="4 GiB",
            dashboard_address=":0",
        ) as cluster,
        Client(cluster) as client,
    ):
        # Whatever a first call costs a worker (its comm, a task's bookkeeping),
        # paid before the figure without the plugin is taken.
        client.run(_rss)
        (before,) = client.run(_rss).values()
        client.register_plugin(dh.Hoplite())
        (after,) = client.run(_rss).values()
    return before, after


def test_the_plugin_costs_an_idle_worker_under_32_mib_by_default():
    # The shipped default, from the package's own YAML (whatever a test or
    # the user's files set).
    with open(os.path.join(os.path.dirname(dh.__file__), "hoplite.yaml")) as f:
        default = yaml.safe_load(f)["hoplite"]["buffer-pool-reserve"]
    assert default == 0
    before, after = _rss_before_and_after_the_plugin({"hoplite.buffer-pool-reserve": default})
    assert after - before <= 32 * MiB, f"{(after - before) / MiB:.1f} MiB"


def test_an_automatic_reserve_is_resident_from_the_start():
    """The counterpart, and the measure's check: ``auto`` on a 4 GiB worker
    maps and faults in a sixteenth of it, 256 MiB, as the plugin starts."""
    before, after = _rss_before_and_after_the_plugin({"hoplite.buffer-pool-reserve": "auto"})
    assert after - before >= 240 * MiB, f"{(after - before) / MiB:.1f} MiB"
