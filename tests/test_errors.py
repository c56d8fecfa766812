"""A reduce node's failure crosses to the root as a reply and comes back as the
same kind of error: an input that does not fit stays a ReduceInputError (final,
named), anything else becomes a NodeFailed naming the node's worker."""

from __future__ import annotations

from dask_hoplite.errors import NodeFailed, ReduceInputError, node_error, node_reply


def test_an_input_that_does_not_fit_stays_recognisable():
    e = node_error(node_reply(ReduceInputError("input 'x' has shape (2,)")), "tcp://a:1")
    assert isinstance(e, ReduceInputError) and str(e) == "input 'x' has shape (2,)"


def test_other_failures_name_the_node_and_the_error():
    e = node_error(node_reply(TypeError("boom")), "tcp://a:1")
    assert isinstance(e, NodeFailed) and not e.unreachable
    assert str(e) == "TypeError: boom" and e.address == "tcp://a:1"
    refused = node_error(node_reply("reduction aborted"), "tcp://b:2")
    assert isinstance(refused, NodeFailed) and str(refused) == "reduction aborted"


def test_success_is_no_error():
    assert node_error({"status": "OK"}, "tcp://a:1") is None
