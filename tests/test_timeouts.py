"""A bounded wait on a future keeps a result that comes as the timer fires
(:mod:`dask_hoplite.timeouts`): a directory decision, an announcement or a
peer's signal that lands in that turn is delivered, not lost as a timeout."""

from __future__ import annotations

import asyncio
import sys

import pytest
from distributed.utils import wait_for
from distributed.utils_test import gen_test

from dask_hoplite.timeouts import wait_for_future

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="asyncio.timeout, the edge this guards, is 3.11+"
)


def resolved_as_the_timer_fires() -> asyncio.Future[str]:
    """A future resolved in the loop turn a zero timeout fires in (its
    callback was queued before the timer)."""
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(fut.set_result, "decided")
    return fut


@gen_test()
async def test_a_result_that_lands_as_the_timeout_fires_is_returned():
    assert await wait_for_future(resolved_as_the_timer_fires(), 0) == "decided"
    assert await wait_for_future(resolved_as_the_timer_fires(), 0, shield=True) == "decided"


@gen_test()
async def test_the_plain_bounded_wait_loses_that_result():
    # The edge wait_for_future exists for: if this ever passes, the helper
    # may go.
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(resolved_as_the_timer_fires(), 0)


@gen_test()
async def test_a_future_nobody_resolves_times_out_cancelled_or_kept():
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await wait_for_future(fut, 0.01, shield=True)
    assert not fut.done()  # shielded: still there to be resolved
    with pytest.raises(asyncio.TimeoutError):
        await wait_for_future(fut, 0.01)
    assert fut.cancelled()
