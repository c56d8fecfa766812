"""Bad input from peers and misconfigured deployments: a clear error to
whoever made the mistake, and the cluster keeps running with nothing lost."""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref

import numpy as np
import pytest
from distributed.comm import connect
from distributed.utils import wait_for
from distributed.utils_test import gen_cluster, gen_test
from distributed.worker_state_machine import FreeKeysEvent

import dask_hoplite.compat
from dask_hoplite import Hoplite, HopliteWorker
from dask_hoplite.compat import TESTED_RANGE
from dask_hoplite.core.protocol import PROTOCOL_VERSION, STREAM_OP
from dask_hoplite.core.store import BufferState, ObjectBuffer

SMALL = {"hoplite.min-bytes": "64 KiB", "hoplite.min-block-bytes": "4 KiB"}
LOW = TESTED_RANGE[0]


def checksum(x):
    return float(np.asarray(x).sum())


def request(**kw):
    msg = {
        "op": STREAM_OP,
        "key": "x",
        "offset": 0,
        "block_bytes": 1024,
        "transfer_id": None,
        "protocol": PROTOCOL_VERSION,
        "reply": False,
    }
    msg.update(kw)
    return {k: v for k, v in msg.items() if v is not ...}


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_bad_stream_requests_get_clear_errors_and_the_worker_stays_up(c, s, a, b):
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 100_000, workers=[a.address], key="x")
    assert await c.submit(checksum, x, workers=[a.address]) == float(np.arange(100_000).sum())
    nbytes = 100_000 * 8
    cases = [
        (request(key="no-such-key"), "holds no copy of key 'no-such-key'"),
        (request(offset=-1), "offset must be an int >= 0"),
        (request(offset=nbytes + 1), f"offset {nbytes + 1} is past the end"),
        (request(offset="zero"), "offset must be an int >= 0"),
        (request(block_bytes=0), "block_bytes must be a positive int"),
        (request(protocol=PROTOCOL_VERSION + 7), "protocol version mismatch"),
        (request(key=...), "without a 'key'"),
        (request(transfer_id=[1, 2]), "transfer_id"),
    ]
    comm = await connect(a.address)
    try:
        for msg, expected in cases:
            await comm.write(msg)
            reply = await comm.read()
            assert reply["status"] == "error", msg
            assert expected in reply["message"], (expected, reply)
    finally:
        comm.abort()
    # Nothing was lost, and hoplite still serves the key.
    assert a.status.name == "running" and x.key in a.data
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())
    assert b.plugins["hoplite-worker"].stats["keys-received"] == 1
    assert a.plugins["hoplite-worker"].stats["requests-refused"] == len(cases)


@gen_cluster(client=True, nthreads=[("", 1)], config=SMALL)
async def test_a_stream_its_reader_hung_up_on_leaves_nothing_holding_the_object(c, s, a):
    """A reader that hangs up mid-stream (a receiver that moved to another
    sender, say) breaks the sender's socket write. The error must not keep
    the sender's buffer alive in a reference cycle: once Dask releases the
    key the memory is free, without waiting for the cyclic garbage collector
    (which is off here), so the next object can reuse it."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.ones, 2**22, workers=[a.address], key="x")  # 32 MiB
    await x
    store = a.plugins["hoplite-worker"].store
    stats = a.plugins["hoplite-worker"].stats
    gc.disable()
    try:
        comm = await connect(a.address)
        await comm.write(request(raw=True, block_bytes=2**20))
        assert (await comm.read())["status"] == "OK"
        served = store.get("x")
        assert served is not None
        buf = weakref.ref(served)
        del served
        comm.abort()  # without reading a byte: the sender is blocked in a write
        await wait_for(_until(lambda: stats.get("streams-aborted", 0) == 1), 10)
        del x
        await wait_for(_until(lambda: "x" not in a.data and store.get("x") is None), 10)
        assert buf() is None, gc.get_referrers(buf())
    finally:
        gc.enable()


async def _until(condition):
    while not condition():
        await asyncio.sleep(0.01)


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_directory_rejects_a_mismatched_protocol(c, s, a, b):
    await c.register_plugin(Hoplite())
    reply = await c.scheduler.hoplite_request(key="x", receiver=a.address, protocol=-1)
    assert reply["status"] == "error" and "protocol" in reply["message"]
    reply = await c.scheduler.hoplite_request(
        key="unknown", receiver=a.address, protocol=PROTOCOL_VERSION
    )
    assert reply == {"status": "missing", "gone": True}  # in memory nowhere


@gen_cluster(client=True, nthreads=[("", 1)] * 2, config=SMALL)
async def test_worker_part_of_another_version_refuses_loudly(c, s, a, b):
    with pytest.raises(Exception, match="does not match dask-hoplite 0.0.0-other on the scheduler"):
        await c.register_plugin(HopliteWorker("0.0.0-other"), name="hoplite-worker")
    for w in (a, b):
        assert "gather_dep" not in w.__dict__  # Dask's own path stays in place
    x = c.submit(np.arange, 100_000, workers=[a.address])
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())


@gen_cluster(client=True, nthreads=[("", 1)], config=SMALL)
async def test_a_newer_distributed_starts_with_a_warning(c, s, a):
    """A release newer than the tested ones is not refused: the plugin
    starts, says the release is untested, and works."""
    from distributed.utils_test import captured_logger

    orig = dask_hoplite.compat.installed_distributed_version
    dask_hoplite.compat.installed_distributed_version = lambda: "2027.1.0"
    try:
        with captured_logger("dask_hoplite.scheduler.plugin") as log:
            await c.register_plugin(Hoplite())
    finally:
        dask_hoplite.compat.installed_distributed_version = orig
    assert "runs distributed 2027.1.0, untested" in log.getvalue()
    assert "hoplite_request" in s.handlers and a.plugins["hoplite-worker"].running


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_untested_distributed_is_refused_at_registration(c, s, a, monkeypatch=None):
    orig = dask_hoplite.compat.installed_distributed_version
    dask_hoplite.compat.installed_distributed_version = lambda: "2024.1.0"
    try:
        with pytest.raises(
            Exception, match=rf"needs distributed >= {LOW}.*runs distributed 2024.1.0"
        ):
            await c.register_plugin(Hoplite())
    finally:
        dask_hoplite.compat.installed_distributed_version = orig
    assert "hoplite_request" not in s.handlers
    # A tested version registers fine afterwards.
    await c.register_plugin(Hoplite())
    assert "hoplite_request" in s.handlers


def test_check_distributed_version_messages():
    from dask_hoplite.compat import UnsupportedDistributed, check_distributed_version

    low, high = TESTED_RANGE
    assert check_distributed_version(str(low)) is None
    assert check_distributed_version(str(high)) is None
    # Newer than tested: it starts, with a warning that says so.
    newer = f"{high.major + 1}.1.0"
    warning = check_distributed_version(newer)
    assert warning is not None and f"{newer}, untested" in warning
    for bad in [f"{low.major - 1}.1.0", "2024.1.0", "not-a-version"]:
        with pytest.raises(UnsupportedDistributed):
            check_distributed_version(bad)


@gen_cluster(client=True, nthreads=[("", 1)])
async def test_untested_distributed_is_refused_by_the_worker_part_too(c, s, a):
    """The worker part overrides most of the internals: it checks the release
    itself, also when registered without the scheduler part."""
    orig = dask_hoplite.compat.installed_distributed_version
    dask_hoplite.compat.installed_distributed_version = lambda: "2024.1.0"
    try:
        with pytest.raises(
            Exception, match=rf"needs distributed >= {LOW}.*runs distributed 2024.1.0"
        ):
            await c.register_plugin(HopliteWorker(), name="hoplite-worker")
    finally:
        dask_hoplite.compat.installed_distributed_version = orig
    assert "gather_dep" not in a.__dict__ and STREAM_OP not in a.handlers


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 2,
    config={**SMALL, "hoplite.directory.queue-timeout": "10ms"},
    timeout=60,
)
async def test_a_fetch_that_waits_too_long_for_a_sender_is_done_by_dask(c, s, a, b):
    """Every holder busy past ``hoplite.directory.queue-timeout``: Dask's own
    path fetches the key from its holder (it once took the key for lost on
    that holder and asked again, for ever)."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 100_000, workers=[a.address], key="x")
    await x
    s.plugins["hoplite"].directory.fanout = 0  # no holder ever has an upload slot
    assert await c.submit(checksum, x, workers=[b.address]) == float(np.arange(100_000).sum())
    assert b.plugins["hoplite-worker"].stats.get("keys-received", 0) == 0  # not through hoplite


@gen_cluster(client=True, nthreads=[("", 1)], config=SMALL)
async def test_a_key_released_while_serialised_for_a_peer_leaves_no_copy(c, s, a):
    """A peer asks for a key that lives only in Dask's memory here; while the
    sender serialises it (off the event loop), Dask releases the key. The
    copy must not be added afterwards: nothing would release it again, and
    the worker would hold the object's bytes for good (seen in chaos runs)."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 1_000_000, workers=[a.address], key="x")
    await x
    plugin = a.plugins["hoplite-worker"]
    assert "x" not in plugin.store  # computed here: only in a.data so far
    serving = asyncio.create_task(plugin.parts.sender.source("x"))
    await asyncio.sleep(0)  # the sender is serialising x now
    a.handle_stimulus(FreeKeysEvent(keys=["x"], stimulus_id="test-release"))
    assert "x" not in a.data
    assert await serving is None
    assert "x" not in plugin.store


@gen_cluster(client=True, nthreads=[("", 1)], config={**SMALL, "hoplite.resume-window": "1s"})
async def test_a_key_released_while_it_completes_a_partial_copy_leaves_no_copy(c, s, a):
    """A partial copy of a key waits for a resume; the key is computed here,
    and while its value is serialised to complete that copy, Dask releases
    the key. The copy is kept for a resume, then goes: it must not be
    completed from the released value, which would keep it for good."""
    await c.register_plugin(Hoplite())
    x = c.submit(np.arange, 1_000_000, workers=[a.address], key="x")
    await x
    plugin = a.plugins["hoplite-worker"]
    ctx = plugin.parts.ctx
    value = ObjectBuffer.from_frames("x", *await ctx.serialize(a.data["x"]))
    partial = plugin.store.announce("x")
    partial.allocate(value.layout)
    partial.write(0, bytes(value.frames()[0])[:4096])  # a stream got this far, then died
    # Hold the serialisation until Dask has released the key: the release
    # must land while the value is being serialised, whatever the machine.
    serialising, go_on = asyncio.Event(), asyncio.Event()
    serialize = ctx.serialize

    async def held_serialize(v):
        serialising.set()
        await go_on.wait()
        return await serialize(v)

    ctx.serialize = held_serialize
    completing = asyncio.create_task(plugin.parts.partial_copies._adopt_local("x", partial))
    await wait_for(serialising.wait(), 10)
    # Nobody wants x any more: the scheduler forgets it and frees it here.
    # (Freeing it here first would race the client's release: the scheduler,
    # told the only copy went while the client still held x, recomputes it,
    # and the copy is rightly completed from that new value.)
    x.release()

    async def forgotten():
        while "x" in s.tasks or "x" in a.data:
            await asyncio.sleep(0.01)

    await wait_for(forgotten(), 10)
    go_on.set()
    await completing
    # Kept for a resume (or already expired on a slow machine), never completed.
    assert partial.state in (BufferState.RECEIVING, BufferState.FAILED)
    assert plugin.stats.get("partial-copies-kept", 0) == 1
    assert plugin.stats.get("partial-copies-adopted", 0) == 0
    while "x" in plugin.store:  # until the resume window ends
        await asyncio.sleep(0.05)


@gen_test()
async def test_a_failed_segment_stops_the_other_segments_and_names_the_bad_input():
    # A reduce in parts runs one tree per segment on the root's worker: when
    # one fails, the others must stop (their roots abort their nodes) rather
    # than stream on for a result nobody takes, and the error that names an
    # input wins over a lost connection.
    from dask_hoplite.errors import ReduceInputError
    from dask_hoplite.worker.context import all_or_cancel

    started, cancelled = asyncio.Event(), []

    async def streams_on(i):
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def fails(e):
        await started.wait()
        raise e

    with pytest.raises(ReduceInputError, match="input 'x'"):
        await all_or_cancel(
            [
                streams_on(0),
                fails(ReduceInputError("input 'x' has shape (2,), not (3,)")),
                streams_on(2),
            ],
            "reduce segment",
        )
    await asyncio.sleep(0)
    assert sorted(cancelled) == [0, 2]
    assert await all_or_cancel([asyncio.sleep(0, result=i) for i in range(3)], "x") == [0, 1, 2]


@gen_cluster(
    client=True,
    nthreads=[("", 1)] * 3,
    config={**SMALL, "hoplite.stall-timeout": "30s"},
    timeout=60,
)
async def test_a_child_keeps_its_partial_result_until_its_parent_releases_it(c, s, a, b, w):
    """Chain a <- b <- w. Node b reads all of w's partial result and finishes
    while its parent (the root, not started here) has read none of b's. Were
    b to die now, its replacement would read w's partial result again from
    where the root stopped, so w must still serve it: it lets go only when b
    releases it, which b does once it is released itself."""
    from dask_hoplite.core.reduce_spec import ReduceSpec

    await c.register_plugin(Hoplite())
    n = 2**18  # 2 MiB of float64 per input
    xs = [
        c.submit(np.full, n, float(i + 1), workers=[wk.address], key=f"x{i}")
        for i, wk in enumerate((a, b, w))
    ]
    await c.gather(xs)
    spec = ReduceSpec(
        rid="held",
        op="sum",
        inputs=("x0", "x1", "x2"),
        addresses=(a.address, b.address, w.address),
        parent=(None, 0, 1),
        shape=(n,),
        dtype="float64",
        block_bytes=2**16,
    )
    nodes = [
        asyncio.create_task(a.rpc(wk.address).hoplite_reduce_node(spec=spec.to_msg(), slot=slot))
        for slot, wk in ((2, w), (1, b))
    ]
    stores = {wk: wk.plugins["hoplite-worker"].store for wk in (b, w)}
    mid = stores[b].announce(spec.partial_key(1))
    while mid.state is not BufferState.COMPLETE:  # b has read all of w
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # time for w to let go, were it to
    leaf = await w.plugins["hoplite-worker"].parts.sender.source(spec.partial_key(2))
    assert leaf is not None, "w dropped its partial result once b had read it"
    np.testing.assert_array_equal(np.frombuffer(leaf.frames()[0], dtype="float64"), 3.0)
    np.testing.assert_array_equal(np.frombuffer(mid.frames()[0], dtype="float64"), 5.0)
    assert not any(t.done() for t in nodes)
    # The root has the result: it releases b, and b releases w.
    await a.rpc(b.address).hoplite_reduce_release(rid="held", slots=[1])
    assert [r["status"] for r in await asyncio.gather(*nodes)] == ["OK", "OK"]
    while any(len(st) for st in stores.values()):
        await asyncio.sleep(0.01)


@pytest.mark.skipif(
    sys.version_info < (3, 11),
    reason="Python 3.10 has no asyncio.timeout: distributed's wait_for is asyncio's there",
)
@gen_test()
async def test_a_cancelled_stream_stops_even_as_its_next_block_arrives():
    # Before Python 3.12, asyncio.wait_for swallowed a cancellation that came
    # while the read it bounded completed: a retired worker's stream read on
    # to the object's end, taking its sender's upload from the receivers
    # that resumed there (a retirement cost up to 2.7x S/B). Here the block
    # lands in the same turn of the loop as the cancellation, every time.
    from dask_hoplite.worker.streams import read_raw

    loop = asyncio.get_running_loop()
    block: asyncio.Future[int] = loop.create_future()

    class OneBlock:  # the one call of tornado's IOStream that read_raw makes
        def read_into(self, into):
            return block

    reading = asyncio.create_task(read_raw(OneBlock(), memoryview(bytearray(4)), 10, "peer"))
    await asyncio.sleep(0)  # the read waits for its block
    block.set_result(4)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
