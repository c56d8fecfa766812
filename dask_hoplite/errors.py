"""Every exception dask-hoplite raises on purpose, in one place.

Pure: this module imports nothing, so the sans-IO core (:mod:`dask_hoplite.core`)
and the I/O shells raise and catch the same types. Where an error crosses a
boundary (an RPC reply, a Dask task's result), the shell that sends it turns it
into a message and the shell that receives it turns the message back into the
type here (see :mod:`dask_hoplite.worker.reduce_node`).
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A peer sent a message that does not follow the block-stream protocol."""


class LayoutMismatch(ProtocolError):
    """A child of a reduce node streams another size or mode than the tree's."""


class LayoutChanged(ValueError):
    """A sender's copy is not the object a partially filled buffer holds the
    beginning of (e.g. a non-deterministic task was recomputed)."""


class StreamStalled(TimeoutError):
    """A peer made no progress for ``hoplite.stall-timeout``."""


class ReduceInputError(ValueError):
    """An input of a reduction does not fit the others (shape or dtype) or is
    not an array. Final: a reduction that meets one is not retried."""


class NodeFailed(RuntimeError):
    """A node of a reduce tree failed (its worker died, stalled or refused)."""

    def __init__(self, message: str, address: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.address = address
        #: The node's worker did not answer at all (it is likely dead), as
        #: opposed to answering with an error.
        self.unreachable = unreachable


class VersionMismatch(RuntimeError):
    """The worker's dask-hoplite differs from the scheduler's."""


class UnsupportedDistributed(RuntimeError):
    """The installed ``distributed`` is outside the tested range, or one of the
    private internals dask-hoplite overrides changed (see :mod:`dask_hoplite.compat`)."""
