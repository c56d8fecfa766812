"""Hoplite over the comm backends Dask users run: TLS (raw mode through Dask's
own security settings) and inproc (message mode, with acknowledgements)."""

from __future__ import annotations

import asyncio
import contextlib

import dask
import numpy as np
from distributed import Client, LocalCluster, wait
from distributed.security import Security
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite

SMALL = {
    "hoplite.min-bytes": "64 KiB",
    "hoplite.min-block-bytes": "4 KiB",
    "hoplite.block-bytes": "64 KiB",
    "hoplite.window-bytes": "128 KiB",
}


def checksum(x, i=0):
    return int(np.asarray(x).view(np.uint8).astype(np.uint64).sum())


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 3,
    security=Security.temporary(),  # self-signed, encryption required
    config=SMALL,
)
async def test_broadcast_over_tls(c, s, a, b, d):
    assert s.address.startswith("tls://")
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 300_000, workers=[a.address])
    await wait(x)
    expected = checksum(np.arange(300_000))
    got = await c.gather(
        [c.submit(checksum, x, i, workers=[w.address], pure=False) for i, w in enumerate((b, d))]
    )
    assert got == [expected, expected]
    assert [w.plugins["hoplite-worker"].stats.get("keys-received") for w in (b, d)] == [1, 1]


@contextlib.asynccontextmanager
async def inproc_cluster():
    """3 in-process workers over the inproc comm (message mode), plugin registered."""
    async with (
        LocalCluster(
            n_workers=3,
            threads_per_worker=1,
            processes=False,
            asynchronous=True,
            dashboard_address=":0",
        ) as cluster,
        Client(cluster, asynchronous=True) as c,
    ):
        assert cluster.scheduler.address.startswith("inproc://")
        await c.register_plugin(Hoplite())
        yield cluster, c


def test_broadcast_over_inproc_uses_message_mode():
    async def main():
        with dask.config.set(SMALL):
            async with inproc_cluster() as (cluster, c):
                ws = sorted(cluster.scheduler.workers)
                x = c.submit(np.arange, 500_000, workers=[ws[0]])
                await wait(x)
                got = await c.gather(
                    [
                        c.submit(checksum, x, i, workers=[w], pure=False)
                        for i, w in enumerate(ws[1:])
                    ]
                )
                assert got == [checksum(np.arange(500_000))] * 2
                stats = [w.plugins["hoplite-worker"].stats for w in cluster.workers.values()]
                assert sum(s.get("keys-received", 0) for s in stats) == 2

    asyncio.run(main())


def test_reduce_over_inproc_uses_buffered_children():
    import dask_hoplite as dh

    async def main():
        async with inproc_cluster() as (cluster, c):
            ws = sorted(cluster.scheduler.workers)
            arrays = [np.arange(300_000, dtype="f8") * i for i in range(5)]
            futures = [
                await c.scatter(a, workers=[ws[i % 3]], hash=False) for i, a in enumerate(arrays)
            ]
            total = dh.reduce(futures, "sum")  # a Future at once, as client.submit
            np.testing.assert_array_equal(await total, sum(arrays))
            parts = dh.allreduce(futures, "max")  # Futures at once, one per input
            assert len(parts) == len(futures)
            for p in parts:
                np.testing.assert_array_equal(await p, arrays[-1])
            for value in await c.gather(parts):  # the values, in input order
                np.testing.assert_array_equal(value, arrays[-1])

    asyncio.run(main())
