"""Waiting for a future with a timeout, without losing a result to the timer.

Every bounded wait in the package is :func:`distributed.utils.wait_for`
(``asyncio.timeout`` on Python 3.11 and later): before 3.12,
``asyncio.wait_for`` swallows a cancellation that arrives as its awaitable
completes (CPython gh-86296), and a cancelled stream then reads on to its end.
``asyncio.timeout`` has the opposite edge: when the future is resolved in the
very turn the timer fires, the wait is cancelled anyway and the result is
dropped. For a wait on a future someone resolves (a directory decision, an
announcement, a peer's signal) that result must not be lost:
:func:`wait_for_future` returns it.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from distributed.utils import wait_for

T = TypeVar("T")


async def wait_for_future(fut: asyncio.Future[T], timeout: float, *, shield: bool = False) -> T:
    """``fut``'s result within ``timeout`` seconds, else
    :class:`asyncio.TimeoutError`; a result set in the turn the timeout
    fired is returned. ``shield``: the timeout leaves ``fut`` pending (to be
    waited for again, or resolved later); otherwise it cancels it."""
    try:
        return await wait_for(asyncio.shield(fut) if shield else fut, timeout)
    except asyncio.TimeoutError:
        if fut.done() and not fut.cancelled():
            return fut.result()
        raise
