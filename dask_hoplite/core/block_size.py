"""The block of a stream, fitted to the chain it travels down. Pure: no I/O.

A relay forwards a block once all of it has landed (a receiver reads a
stream a block at a time and then tells its own readers), so in a chain each
hop starts one block behind the one above it. The last receiver of a chain
``d`` hops deep gets its last byte ``d`` blocks' time after the source's
link would have carried the whole object: the pipeline fill, ``d b / B``
on top of ``S / B``. As a share of ``S / B`` that is ``d b / S``: the rate
cancels, and one fixed block makes the fill grow with the depth and shrink
with the object. 512 KiB blocks cost a 64 MiB object 5.5% over 7 hops and
12% over 15.

:func:`fitted_block` picks the largest block whose fill stays within a share
of the transfer (``hoplite.broadcast.pipeline-fill``), no larger than the
block the stream would read unfitted (``hoplite.block-bytes`` at most, a
``min-blocks``-th of the object at least, so even a small object pipelines:
:meth:`~dask_hoplite.config.HopliteConfig.block_size_for`). Each block costs
the relay CPU (its reader wakes, then its own readers write), so none carries
less than :data:`MIN_BLOCK_SECONDS` at the host's rate nor less than
``hoplite.min-block-bytes``.

The depth is the deepest the chain may become: every other host of the
cluster (the directory extends a chain as receivers ask, so the receivers
known at a stream's start are not all of them). A key split into ``k`` byte
ranges travels down ``k`` trees at once; its ranges share each host's link,
so a hop of range ``j`` takes ``k`` blocks' time at ``B``, and the budget is
divided by ``k`` too.
"""

from __future__ import annotations

#: The least time a block carries at the host's rate (seconds). A block costs
#: a relay about 55 us of CPU (measured: 8 hosts at 1 Gbit/s, 64 MiB, 140 KiB
#: blocks against 512 KiB, 8 worker processes on 2 cores): with a block a
#: millisecond long, 5% of a core per stream, and the CPU-bound regime's p90
#: went from 1.20-1.22x to 1.38-1.52x of S/B. At 4 ms a stream costs a relay
#: about 1.5% of a core; the fill this floor leaves is 4 ms a hop.
MIN_BLOCK_SECONDS = 4e-3


def fitted_block(
    unfitted: int,
    nbytes: int,
    depth: int,
    bandwidth: float,
    fill_share: float,
    min_block_bytes: int,
    parts: int = 1,
) -> int:
    """The block of a stream of one of ``parts`` byte ranges of an object of
    ``nbytes``, down a chain of at most ``depth`` hops at ``bandwidth``
    bytes per second per host: the largest, up to ``unfitted``, whose
    pipeline fill is at most ``fill_share`` of the object's
    ``nbytes / bandwidth``, within the floors the module docstring gives."""
    if nbytes < 0 or depth < 0 or bandwidth <= 0 or fill_share <= 0 or parts < 1:
        raise ValueError(
            "need nbytes >= 0, depth >= 0, bandwidth > 0, fill_share > 0 and parts >= 1 "
            f"(got {nbytes}, {depth}, {bandwidth}, {fill_share}, {parts})"
        )
    if depth == 0:
        return unfitted
    budget = int(fill_share * nbytes / (depth * parts))
    floor = max(min_block_bytes, int(bandwidth * MIN_BLOCK_SECONDS))
    return min(unfitted, max(floor, budget))
