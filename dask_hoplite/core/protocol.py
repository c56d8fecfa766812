"""The block-stream protocol: its messages, their validation, and the sender's
flow-control window. Pure: the coroutines that move these messages over
``distributed.comm`` live in :mod:`dask_hoplite.worker.streams`.

A stream, on one comm, after the receiver's request::

    receiver -> sender   {"op": "hoplite_stream", "key", "offset", "end", "part",
                          "protocol", "transfer_id", "block_bytes", "raw", "who",
                          "reply": False}
    sender   -> receiver {"status": "OK", "header", "lengths", "raw"}  (the Layout)
                       | {"status": "error", "message"}                (then nothing)

then, in *message mode* (any comm backend)::

    sender   -> receiver {"offset": o, "data": <block>}  ...   (in order, o ascending)
    receiver -> sender   {"ack": progress}                 ...   (one per block)

where the sender keeps at most ``window_bytes`` sent but unacknowledged and the
stream ends when the receiver acknowledged every byte; or, in *raw mode*, when
both ends run over a TCP or TLS comm (both asked for it): the bytes
[offset, end) follow as they are, read by the receiver straight into its
buffer. Raw mode needs no acknowledgements (TCP's own flow control applies:
the sender awaits each write into the socket) and costs no copy in user
space, which is what keeps a chain of relays network-bound on small hosts.
After the last byte the comm is back at a message boundary and is reused.
Resuming is a new request with the offset the receiver reached. ``end`` is
None (the object's size) except for a *patch*, the few blocks of a reduce
node's stream that a dead node's parent reads in its place
(:mod:`dask_hoplite.core.tree_spread`). ``part`` is None except for one byte
range of a key the directory split (:mod:`dask_hoplite.core.byte_ranges`):
``[j, k]``, and the stream covers the bytes of range ``j`` of ``k`` from
``offset`` on (both ends learn the object's size only from the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dask.typing import Key

from dask_hoplite.core.byte_ranges import range_bounds
from dask_hoplite.errors import ProtocolError

#: Bumped on any incompatible change of the messages above or of the
#: worker <-> scheduler directory messages. Peers with another value refuse.
PROTOCOL_VERSION = 5  # 2: streams with an end (patches); 3: byte ranges; 4: reductions
# planned on the scheduler (hoplite_plan_reduction, hoplite_replan_tree); 5: reduction
# runs numbered ``<request>-r<n>``, a stale run's messages refused

STREAM_OP = "hoplite_stream"
#: The scheduler's stream message that stops a collective's task on a worker
#: (:mod:`dask_hoplite.scheduler.cancellation` sends it,
#: :mod:`dask_hoplite.worker.running_tasks` carries it out).
CANCEL_OP = "hoplite-cancel"


@dataclass(frozen=True)
class StreamRequest:
    key: Key
    offset: int
    block_bytes: int
    transfer_id: int | None
    raw: bool = False
    #: The receiving worker's address, for the sender's transfer log (None:
    #: the receiver is not a worker, or did not say).
    who: str | None = None
    #: The byte the stream stops at (None: the end of the object).
    end: int | None = None
    #: ``(j, k)``: the stream covers byte range ``j`` of ``k`` (None: all).
    part: tuple[int, int] | None = None

    @classmethod
    def parse(cls, msg: dict[str, Any]) -> StreamRequest:
        """Validate a request; raises :class:`ProtocolError` naming the fault."""
        version = msg.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version mismatch: peer speaks {version!r}, this worker "
                f"speaks {PROTOCOL_VERSION} (install the same dask-hoplite everywhere)"
            )
        if "key" not in msg:
            raise ProtocolError("stream request without a 'key'")
        offset = msg.get("offset")
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ProtocolError(f"offset must be an int >= 0, got {offset!r}")
        block = msg.get("block_bytes")
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ProtocolError(f"block_bytes must be a positive int, got {block!r}")
        tid = msg.get("transfer_id")
        if tid is not None and not isinstance(tid, int):
            raise ProtocolError(f"transfer_id must be an int or None, got {tid!r}")
        who = msg.get("who")
        if who is not None and not isinstance(who, str):
            raise ProtocolError(f"who must be an address or None, got {who!r}")
        end = msg.get("end")
        if end is not None and (not isinstance(end, int) or isinstance(end, bool) or end < offset):
            raise ProtocolError(f"end must be None or an int >= offset {offset}, got {end!r}")
        part = msg.get("part")
        if part is not None:
            if (
                not isinstance(part, (list, tuple))
                or len(part) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in part)
                or not 0 <= part[0] < part[1]
            ):
                raise ProtocolError(f"part must be None or [j, k] with 0 <= j < k, got {part!r}")
            part = (int(part[0]), int(part[1]))
        return cls(msg["key"], offset, block, tid, bool(msg.get("raw", False)), who, end, part)

    def stop(self, nbytes: int) -> int:
        """Where the stream of an object of ``nbytes`` stops."""
        if self.part is not None:
            return range_bounds(nbytes, *self.part)[1]
        return nbytes if self.end is None else min(self.end, nbytes)

    def start(self, nbytes: int) -> int:
        """Where the stream of an object of ``nbytes`` starts: ``offset``, or
        its range's first byte if that is later."""
        if self.part is not None:
            return max(self.offset, range_bounds(nbytes, *self.part)[0])
        return self.offset

    def to_msg(self) -> dict[str, Any]:
        return {
            "op": STREAM_OP,
            "key": self.key,
            "offset": self.offset,
            "end": self.end,
            "part": None if self.part is None else list(self.part),
            "block_bytes": self.block_bytes,
            "transfer_id": self.transfer_id,
            "protocol": PROTOCOL_VERSION,
            "raw": self.raw,
            "who": self.who,
            "reply": False,
        }


def error_reply(message: str) -> dict[str, Any]:
    return {"status": "error", "message": message}


#: A sender's answer to a stream request while Dask's limit on its transfers
#: out is reached (as ``Worker.get_data`` answers Dask's own requests).
BUSY_REPLY: dict[str, Any] = {"status": "busy"}


def parse_block(msg: Any, expected_offset: int) -> tuple[int, Any]:
    if not isinstance(msg, dict) or "offset" not in msg or "data" not in msg:
        if isinstance(msg, dict) and msg.get("status") == "error":
            raise ProtocolError(f"sender failed: {msg.get('message')}")
        raise ProtocolError(f"expected a block message, got {type(msg).__name__}")
    offset = msg["offset"]
    if offset != expected_offset:
        raise ProtocolError(f"block at offset {offset!r}, expected {expected_offset}")
    return offset, msg["data"]


def parse_ack(msg: Any) -> int:
    if not isinstance(msg, dict) or not isinstance(msg.get("ack"), int):
        raise ProtocolError(f"expected an ack message, got {msg!r}")
    return int(msg["ack"])


class SendWindow:
    """Sender-side flow control: bytes in flight are bounded by ``window_bytes``."""

    def __init__(self, start: int, window_bytes: int) -> None:
        self.sent = start
        self.acked = start
        self.window_bytes = window_bytes

    def can_send(self) -> bool:
        return self.sent - self.acked < self.window_bytes

    def on_sent(self, end: int) -> None:
        self.sent = end

    def on_ack(self, progress: int) -> None:
        if not self.acked <= progress <= self.sent:
            raise ProtocolError(f"ack {progress} outside the window [{self.acked}, {self.sent}]")
        self.acked = progress
