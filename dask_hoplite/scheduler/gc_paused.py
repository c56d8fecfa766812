"""No garbage collection while the scheduler's loop plans.

A plan of many inputs builds thousands of short-lived containers (a heap of
candidate placements, per-input lists, the plan's message), and all of them
die by reference counting as soon as it returns. But CPython counts
allocations, not lifetimes: every 700 of them it runs a young collection, and
whatever is alive then moves one generation up. Thousands of a plan's
temporaries were moved up per plan, and once enough had, CPython ran a full
collection of the scheduler's whole heap, inside the plan: about one plan in
twenty held the loop 100 ms instead of 6 ms (``benchmarks/plan_time.py``).

With collection paused for the synchronous planning only, the temporaries
die young without being moved up, so planning no longer brings the next full
collection closer. Nothing awaits inside: the pause never outlasts the
plan, and no other coroutine runs under it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection in the body (a synchronous one); the
    collector's previous state afterwards (a caller that disabled it keeps
    it disabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
