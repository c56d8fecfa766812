"""Stream-request validation and the sender's flow-control window."""

from __future__ import annotations

import pytest

from dask_hoplite.core.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    SendWindow,
    StreamRequest,
    parse_ack,
    parse_block,
)


def good(**kw):
    msg = StreamRequest("k", 0, 1024, 7, raw=True).to_msg()
    msg.update(kw)
    return msg


def test_roundtrip():
    req = StreamRequest.parse(good())
    assert req == StreamRequest("k", 0, 1024, 7, True)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"protocol": PROTOCOL_VERSION + 1}, "protocol version mismatch"),
        ({"offset": -1}, "offset must be an int >= 0"),
        ({"offset": "0"}, "offset must be an int >= 0"),
        ({"offset": True}, "offset must be an int >= 0"),
        ({"block_bytes": 0}, "block_bytes must be a positive int"),
        ({"transfer_id": "x"}, "transfer_id"),
        ({"offset": 8, "end": 4}, "end must be None or an int >= offset 8"),
        ({"end": "9"}, "end must be None or an int"),
        ({"end": True}, "end must be None or an int"),
    ],
)
def test_bad_requests_name_the_fault(change, match):
    with pytest.raises(ProtocolError, match=match):
        StreamRequest.parse(good(**change))


def test_a_patch_request_names_where_it_stops():
    """A reduce node reads a dead child's place in patches: a stream that
    stops at ``end`` instead of the object's size."""
    req = StreamRequest.parse(good(offset=4096, end=12288))
    assert req.end == 12288 and req.stop(2**20) == 12288
    assert req.stop(8192) == 8192  # never past the object
    whole = StreamRequest.parse(good())
    assert whole.end is None and whole.stop(2**20) == 2**20


def test_request_without_key():
    msg = good()
    del msg["key"]
    with pytest.raises(ProtocolError, match="without a 'key'"):
        StreamRequest.parse(msg)


def test_blocks_and_acks_are_checked():
    assert parse_block({"offset": 5, "data": b"x"}, 5) == (5, b"x")
    with pytest.raises(ProtocolError, match="expected 4"):
        parse_block({"offset": 5, "data": b"x"}, 4)
    with pytest.raises(ProtocolError, match="sender failed: boom"):
        parse_block({"status": "error", "message": "boom"}, 0)
    with pytest.raises(ProtocolError, match="expected an ack"):
        parse_ack({"nope": 1})


def test_send_window_bounds_bytes_in_flight():
    w = SendWindow(start=100, window_bytes=10)
    assert w.can_send()
    w.on_sent(110)
    assert not w.can_send()
    w.on_ack(104)
    assert w.can_send()
    with pytest.raises(ProtocolError, match="outside the window"):
        w.on_ack(111)
    with pytest.raises(ProtocolError, match="outside the window"):
        w.on_ack(103)
