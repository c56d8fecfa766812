"""What Dask lets a user set about transfers holds with the plugin: a
``Worker`` subclass's own ``gather_dep`` is called, and hoplite's streams
count against Dask's limit on a worker's transfers out."""

from __future__ import annotations

import asyncio

import numpy as np
from distributed import Worker
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.worker.context import PLUGIN_NAME

SMALL = {"hoplite.min-bytes": "64 KiB", "hoplite.min-block-bytes": "4 KiB"}


class CountingGatherDep(Worker):
    """A subclass that overrides ``gather_dep``, as distributed's own
    ``BlockedGatherDep`` does."""

    def __init__(self, *args, **kwargs):
        self.gather_dep_calls = 0
        super().__init__(*args, **kwargs)

    async def gather_dep(self, *args, **kwargs):
        self.gather_dep_calls += 1
        return await super().gather_dep(*args, **kwargs)


@gen_cluster(
    client=True,
    nthreads=[("", 1), ("", 1)],
    config=SMALL,
    worker_kwargs={},
    Worker=CountingGatherDep,
)
async def test_a_subclass_override_of_gather_dep_is_called(c, s, a, b):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 100_000, dtype="float64", workers=[a.address])
    total = c.submit(np.sum, x, workers=[b.address])
    assert await total == float(np.arange(100_000.0).sum())
    assert b.gather_dep_calls == 1  # the subclass's own override ran
    plugin = b.plugins[PLUGIN_NAME]
    # That worker fetches Dask's way, and says why; the rest of hoplite runs.
    assert "fetch" not in plugin.features and "gather_dep" not in vars(b)
    (off,) = plugin.features.off
    assert "CountingGatherDep overrides gather_dep" in off.reason
    assert "replicate" in plugin.features and plugin.running


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)], config=SMALL)
async def test_a_sender_at_dasks_transfer_limit_is_busy_for_hoplite_too(c, s, a, b):
    """``transfer_outgoing_count_limit`` reached: the holder refuses hoplite's
    stream as Dask's ``get_data`` refuses Dask's own; the receiver takes
    Dask's path, which waits in ``fetch`` until the holder is free."""
    await c.register_plugin(Hoplite())
    a.transfer_outgoing_count_limit = 0
    x = c.submit(np.arange, 100_000, dtype="float64", workers=[a.address], key="x")
    total = c.submit(np.sum, x, workers=[b.address], key="total")
    # The key waits on b: refused by hoplite's sender, then by Dask's.
    while not (a.plugins[PLUGIN_NAME].stats.get("requests-busy") and "x" in b.state.tasks):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)
    assert b.state.tasks["x"].state in ("fetch", "flight")
    assert not total.done()
    assert b.plugins[PLUGIN_NAME].stats.get("senders-busy", 0) >= 1
    a.transfer_outgoing_count_limit = 4
    assert await total == float(np.arange(100_000.0).sum())


class CountingGetData(Worker):
    """A subclass that serves its data its own way (``get_data``), as
    distributed's own ``BrokenWorker`` tests do."""

    def __init__(self, *args, **kwargs):
        self.get_data_calls = 0
        super().__init__(*args, **kwargs)

    async def get_data(self, comm, *args, **kwargs):
        self.get_data_calls += 1
        return await super().get_data(comm, *args, **kwargs)


@gen_cluster(client=True, nthreads=[("", 1)], config=SMALL)
async def test_a_subclass_that_serves_data_its_own_way_is_no_hoplite_peer(c, s, b):
    await c.register_plugin(Hoplite())
    async with CountingGetData(s.address, nthreads=1) as a:
        x = c.submit(np.arange, 100_000, dtype="float64", workers=[a.address])
        total = c.submit(np.sum, x, workers=[b.address])
        assert await total == float(np.arange(100_000.0).sum())
        assert a.get_data_calls == 1  # its own get_data served the key
        plugin = a.plugins[PLUGIN_NAME]
        assert not plugin.running and "transport" not in plugin.features
        assert a.address in s.plugins["hoplite"].directory.outsiders
