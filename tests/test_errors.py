"""A reduce node's failure crosses to the root as a reply and comes back as the
same kind of error: an input that does not fit stays a ReduceInputError (final,
named), anything else becomes a NodeFailed naming the node's worker."""

from __future__ import annotations

import ast
import asyncio
import pathlib

import dask_hoplite
from dask_hoplite.errors import (
    CollectiveAborted,
    NodeFailed,
    NotRegistered,
    ReduceInputError,
    as_exception,
    node_error,
    node_reply,
)


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


def _package_files():
    root = pathlib.Path(dask_hoplite.__file__).parent
    return sorted(p for p in root.rglob("*.py") if p.name != "errors.py")


def test_no_error_is_built_as_a_bare_runtime_error_outside_errors_py():
    """Every failure a user can see has a type of its own, defined in
    errors.py: a raise site and a failure set on a buffer alike."""
    found = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "RuntimeError"
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_every_exception_class_is_defined_in_errors_py():
    found = []
    for path in _package_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    found.append(f"{path.name}:{node.name}")
    assert found == []


def test_a_cancelled_writer_fails_its_buffer_with_a_collective_aborted():
    e = as_exception(asyncio.CancelledError())
    assert isinstance(e, CollectiveAborted) and str(e) == "CancelledError"
    err = KeyError("x")
    assert as_exception(err) is err


def test_a_missing_worker_part_is_named_with_its_address():
    e = NotRegistered.on_worker("tcp://a:1")
    assert isinstance(e, RuntimeError)
    assert str(e) == (
        "dask-hoplite's worker part is not installed on tcp://a:1: "
        "register dask_hoplite.Hoplite() first"
    )
