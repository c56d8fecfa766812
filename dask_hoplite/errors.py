"""Every exception dask-hoplite raises on purpose, in one place.

Pure: this module imports nothing, so the sans-IO core (:mod:`dask_hoplite.core`)
and the I/O shells raise and catch the same types. Where an error crosses a
boundary, it is turned into a message and back here, in one place: a reduce
node's reply to the root (:func:`node_reply`, :func:`node_error`).
"""

from __future__ import annotations

from typing import Any


class ProtocolError(ValueError):
    """A peer sent a message that does not follow the block-stream protocol."""


class SenderBusy(ProtocolError):
    """The sender refused a stream: Dask's limit on its concurrent transfers
    out (``distributed.worker.connections.outgoing``) is reached. The
    receiver takes another holder, or Dask's own path, which waits."""


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


class ReduceInputLost(RuntimeError):
    """An input of a reduction failed, was released before it was ready, or has
    no holder left that can serve it, and the reduction cannot get the ``k``
    inputs it needs without it. Raised the same way whichever path planned the
    reduction (the planning task, an allreduce, a tree waiting for holders)."""


class NotRegistered(RuntimeError):
    """dask-hoplite's worker part is not running on a worker that a
    collective needs: ``client.register_plugin(dask_hoplite.Hoplite())`` (or
    ``--preload dask_hoplite``) was not done, or failed there."""

    @classmethod
    def on_worker(cls, address: str) -> NotRegistered:
        return cls(
            f"dask-hoplite's worker part is not installed on {address}: "
            "register dask_hoplite.Hoplite() first"
        )


class TransferFailed(RuntimeError):
    """A hoplite stream of a key could not go on: the copy it reads from
    failed or stopped, or no sender could be found. A fetch that meets it
    resumes from another holder or falls back to Dask's own transfer."""


class CollectiveAborted(RuntimeError):
    """A collective (or one stream, node or copy of it) was cancelled or
    aborted before it gave its result. The buffers it was writing fail with
    this error, so that their readers stop too."""


class StaleRun(CollectiveAborted):
    """A message or a restart of a reduction run that a later run of the same
    tree superseded. The scheduler numbers the runs of a request in order; a
    worker that has seen run ``n`` refuses the earlier ones, and the
    scheduler plans no restart of them. Final: the superseded run's root
    fails with it instead of restarting (the later run is the live one)."""


class BufferStateError(RuntimeError):
    """An operation on an object buffer that its state does not allow (a write
    to a buffer that is not receiving, a read of one that is not complete).
    Internal: the callers check the state first, so one reaching a user is a
    bug to report."""


class NodeFailed(RuntimeError):
    """A node of a reduce tree failed (its worker died, stalled or refused)."""

    def __init__(self, message: str, address: str, unreachable: bool = False) -> None:
        super().__init__(message)
        self.address = address
        #: The node's worker did not answer at all (it is likely dead), as
        #: opposed to answering with an error.
        self.unreachable = unreachable


class SpreadRefused(ValueError):
    """A dead node of a reduce tree that cannot be spread over its live
    neighbours (the tree is restarted instead). Internal to tree repair."""


class HandoffFailed(ConnectionError):
    """No shared region came from a worker's region server
    (:mod:`dask_hoplite.worker.region_handoff`): it is on another host or in
    another network namespace, gone, or refused. Internal: the caller fetches
    the object over the network instead."""


class VersionMismatch(RuntimeError):
    """The worker's dask-hoplite differs from the scheduler's."""


class UnsupportedDistributed(RuntimeError):
    """The installed ``distributed`` is outside the tested range, or one of the
    private internals dask-hoplite overrides changed (see :mod:`dask_hoplite.compat`)."""


def as_exception(error: BaseException) -> Exception:
    """What a buffer fails with when its writer ended with ``error``: the
    error itself, or for a cancellation (not an :class:`Exception`) a
    :class:`CollectiveAborted` saying so."""
    if isinstance(error, Exception):
        return error
    return CollectiveAborted(f"{type(error).__name__}: {error}".rstrip(": "))


def node_reply(error: BaseException | str) -> dict[str, Any]:
    """The reply of a reduce node that failed with ``error`` (a string: the
    node refused to run). An input that does not fit stays recognisable."""
    if isinstance(error, str):
        return {"status": "error", "message": error}
    if isinstance(error, StaleRun):
        return {"status": "error", "stale": True, "message": str(error)}
    if isinstance(error, ReduceInputError):
        return {"status": "error", "input_error": True, "message": str(error)}
    return {"status": "error", "message": f"{type(error).__name__}: {error}"}


def node_error(reply: dict[str, Any], address: str) -> Exception | None:
    """The error a reduce node's ``reply`` reports (None: it succeeded);
    ``address``: the node's worker."""
    if reply.get("status") == "OK":
        return None
    if reply.get("input_error"):
        return ReduceInputError(reply.get("message"))
    if reply.get("stale"):
        return StaleRun(str(reply.get("message")))
    return NodeFailed(str(reply.get("message")), address)
