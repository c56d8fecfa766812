"""What an operator sees: hoplite's events in ``client.get_events("hoplite")``
and its log records in the workers' own logs."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import numpy as np
from distributed.comm import connect
from distributed.utils_test import gen_cluster

from dask_hoplite import Hoplite
from dask_hoplite.core.protocol import PROTOCOL_VERSION, STREAM_OP

SMALL = {"hoplite.min-bytes": "64 KiB", "hoplite.min-block-bytes": "4 KiB"}


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_a_refused_stream_request_is_an_event_naming_the_reason(c, s, a, b):
    await c.register_plugin(Hoplite())
    comm = await connect(a.address)
    try:
        await comm.write(
            {
                "op": STREAM_OP,
                "key": "no-such-key",
                "offset": 0,
                "block_bytes": 1024,
                "transfer_id": None,
                "protocol": PROTOCOL_VERSION,
                "reply": False,
            }
        )
        assert (await comm.read())["status"] == "error"
    finally:
        comm.abort()

    def refused():
        return [e for _, e in s.get_events("hoplite") if e["action"] == "requests-refused"]

    while not refused():
        await asyncio.sleep(0.01)
    (event,) = refused()
    assert event["worker"] == a.address
    assert "holds no copy of key 'no-such-key'" in event["reason"]
    # The client sees the same story.
    assert [e["action"] for _, e in await c.get_events("hoplite")] == ["requests-refused"]


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_a_key_hoplite_cannot_fetch_is_a_fallback_event(c, s, a, b):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 100_000, workers=[a.address], key="x")
    await x
    # Every holder is busy (no upload slot) and the request waits in the
    # directory's queue for 10 ms only: the fetch goes to Dask's path.
    plugin = s.plugins["hoplite"]
    plugin.directory.fanout = 0
    plugin.service.config = dataclasses.replace(plugin.service.config, queue_timeout=0.01)
    y = c.submit(lambda v: int(v.sum()), x, workers=[b.address], key="y")
    assert await y == int(np.arange(100_000).sum())
    (event,) = [e for _, e in await c.get_events("hoplite") if e["action"] == "fallbacks"]
    assert event["worker"] == b.address and event["key"] == "x"
    assert "directory answered 'missing'" in event["reason"]


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_hoplites_warnings_are_in_the_workers_log(c, s, a):
    await c.register_plugin(Hoplite())
    logging.getLogger("dask_hoplite.worker.receiver").warning("probe %d", 42)
    logs = await c.get_worker_logs()
    assert any("probe 42" in msg for _, msg in logs[a.address])
