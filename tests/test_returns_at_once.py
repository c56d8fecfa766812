"""Every collective returns its futures at once, like ``client.submit``, on a
synchronous and an asynchronous client: the inputs here wait on a
:class:`distributed.Event` that the test sets only after every call returned
(a call that waited for its inputs would hang the test). The results are
right and come one per input, in input order, each on its input's worker."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from conftest import three_workers
from distributed import Client, Event, LocalCluster, wait

import dask_hoplite as dh
from dask_hoplite.compat import worker_addresses

SIZES = [1000, 2**21]  # one task; reduce trees and pipelined copies (16 MiB)
IDS = ["small", "large"]


def gated(name: str, i: int, size: int) -> np.ndarray:
    """Input ``i``, once event ``name`` is set."""
    Event(name).wait()
    return np.full(size, float(i + 1))


def placement(ws: list[str], n: int) -> list[str]:
    """Input ``i``'s worker: not in sorted order, two inputs on one worker."""
    return [ws[(2 - i) % len(ws)] for i in range(n)]


def where(client: Client, futures: list) -> list[set[str]]:
    """The workers holding each of ``futures``."""
    who = client.who_has(futures)
    return [set(who[f.key]) for f in futures]


def inputs_of(client: Client, name: str, ws: list[str], size: int, n: int = 4) -> list:
    """``n`` inputs waiting on event ``name``, input i on ``placement(ws)[i]``."""
    return [
        client.submit(gated, name, i, size, workers=[w], pure=False)
        for i, w in enumerate(placement(ws, n))
    ]


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_collectives_return_before_their_inputs_on_a_synchronous_client(size):
    with three_workers() as client:
        _on_a_synchronous_client(client, size)


def _on_a_synchronous_client(client: Client, size: int) -> None:
    ws = worker_addresses(client)
    name = f"gate-sync-{size}"
    # one set of inputs per collective that places its outputs: another
    # collective's copies of an input would make it held twice
    a, b, c = (inputs_of(client, name, ws, size) for _ in range(3))
    total = dh.reduce(c, "sum")
    first2 = dh.reduce(c, "sum", k=2)
    every = dh.allreduce(a, "max")
    rows = dh.allgather(b)
    copies = dh.broadcast(c[0], workers=ws)
    split = dh.broadcast(c[1], workers=ws, parts=2)
    # every call returned while the inputs wait on the event
    assert not any(f.done() for f in a + b + c)
    assert [len(every), len(rows), len(copies), len(split)] == [4, 4, len(ws), len(ws)]
    Event(name, client=client).set()

    values = [np.full(size, float(i + 1)) for i in range(4)]
    np.testing.assert_array_equal(total.result(), sum(values))
    assert first2.result()[0] == sum(
        values[[f.key for f in c].index(k)][0] for k in dh.reduced_inputs(first2)
    )
    for got in client.gather(every):
        np.testing.assert_array_equal(got, values[-1])
    for got in client.gather(rows):
        assert [x[0] for x in got] == [v[0] for v in values]  # in input order
    assert [x[0] for x in client.gather(copies)] == [1.0] * len(ws)
    assert [x[0] for x in client.gather(split)] == [2.0] * len(ws)
    wait(every + rows + copies)
    # output i on input i's worker; broadcast copies in the order of workers
    assert where(client, every) == [{w} for w in placement(ws, 4)]
    assert where(client, rows) == [{w} for w in placement(ws, 4)]
    assert where(client, copies) == [{w} for w in ws]


@pytest.mark.parametrize("size", SIZES, ids=IDS)
def test_collectives_return_before_their_inputs_on_an_asynchronous_client(size):
    async def main() -> None:
        async with (
            LocalCluster(
                n_workers=3,
                threads_per_worker=1,
                processes=False,
                dashboard_address=":0",
                asynchronous=True,
            ) as cluster,
            Client(cluster, asynchronous=True) as client,
        ):
            await client.register_plugin(dh.Hoplite())
            ws = sorted((await client.scheduler.identity(n_workers=-1))["workers"])
            name = f"gate-async-{size}"
            a, b, c = (inputs_of(client, name, ws, size) for _ in range(3))
            total = dh.reduce(c, "sum")
            every = dh.allreduce(a, "sum")
            rows = dh.allgather(b)
            copies = await dh.broadcast(c[0], workers=ws)
            split = await dh.broadcast(c[1], workers=ws, parts=2)
            every_worker = await dh.broadcast(c[2])  # the workers asked for
            assert not any(f.done() for f in a + b + c)
            assert [len(copies), len(split), len(every_worker)] == [len(ws)] * 3
            with pytest.raises(ValueError, match="workers= is empty"):
                dh.broadcast(c[0], workers=[])  # a bad argument fails at the call
            await Event(name, client=client).set()

            values = [np.full(size, float(i + 1)) for i in range(4)]
            np.testing.assert_array_equal(await total, sum(values))
            assert sorted(await dh.reduced_inputs(total)) == sorted(f.key for f in c)
            for got in await asyncio.gather(*every):  # awaiting a future gives its value
                np.testing.assert_array_equal(got, sum(values))
            for got in await client.gather(rows):
                assert [x[0] for x in got] == [v[0] for v in values]
            assert [x[0] for x in await client.gather(copies)] == [1.0] * len(ws)
            assert [x[0] for x in await client.gather(split)] == [2.0] * len(ws)
            assert [x[0] for x in await client.gather(every_worker)] == [3.0] * len(ws)
            who = await client.scheduler.who_has(
                keys=[f.key for f in every + rows + copies + every_worker]
            )
            # a copy on every named worker, and on every worker, in their order
            assert [set(who[f.key]) for f in copies] == [{w} for w in ws]
            assert [set(who[f.key]) for f in every_worker] == [{w} for w in ws]
            assert [set(who[f.key]) for f in every] == [{w} for w in placement(ws, 4)]
            assert [set(who[f.key]) for f in rows] == [{w} for w in placement(ws, 4)]

    asyncio.run(main())
