"""The client's futures of a collective: inputs turned into futures, the
inputs a reduction's result contains, and inputs kept alive while a
reduction reads them outside Dask's graph."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dask.base import is_dask_collection
from distributed import Client, Future, default_client

#: The attribute of a result future naming the inputs it contains (a list, or
#: the future of a reduction's plan).
INPUTS_ATTR = "_hoplite_reduced_inputs"


def client_of(inputs: Sequence[Any]) -> Client:
    for f in inputs:
        if isinstance(f, Future):
            return f.client
    return default_client()


def as_futures(client: Client, inputs: Sequence[Any]) -> list[Future]:
    out: list[Future] = []
    todo = []
    for i, x in enumerate(inputs):
        if isinstance(x, Future):
            out.append(x)
        elif is_dask_collection(x):
            out.append(None)  # type: ignore[arg-type]
            todo.append((i, x))
        else:
            raise TypeError(
                f"input {i} is a {type(x).__name__}; collectives take Dask futures, "
                "Delayed objects or Dask collections"
            )
    if todo:
        computed = client.compute([x for _, x in todo])
        for (i, _), f in zip(todo, computed, strict=True):
            out[i] = f
    return out


def keep_until_done(keep: list[Future], futures: list[Future]) -> None:
    """Hold the futures ``keep`` (so Dask keeps their keys) until every one
    of ``futures`` is done: those tasks read them outside Dask's graph."""
    if not futures:
        return
    held = list(keep)
    remaining = set(range(len(futures)))

    def done(j: int) -> None:
        remaining.discard(j)
        if not remaining:
            held.clear()

    for j, f in enumerate(futures):
        f.add_done_callback(lambda _, j=j: done(j))


async def until_done(future: Future) -> None:
    """Wait, on the client's event loop, until ``future`` is done (finished,
    erred or cancelled), without fetching its value."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    future.add_done_callback(lambda _: loop.call_soon_threadsafe(done.set))
    await done.wait()
