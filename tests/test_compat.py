"""The list of private distributed/dask internals dask-hoplite touches
(``dask_hoplite.compat.PRIVATE_INTERNALS``) holds on the installed release:
each is there, with the parameters or fields dask-hoplite uses. On a release
that changed one, the first test fails naming it and what changed."""

from __future__ import annotations

import os

import pytest
from distributed.comm import connect
from distributed.utils_test import gen_cluster

from dask_hoplite.compat import PRIVATE_INTERNALS, Internal, check_internals
from dask_hoplite.errors import UnsupportedDistributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@gen_cluster(nthreads=[("", 1)])
async def test_every_private_internal_is_there_as_dask_hoplite_uses_it(s, a):
    comm = await connect(a.address)  # a live TCP comm, for its tornado stream
    try:
        check_internals([s, s.extensions["stealing"], a, comm], complete=True)
    finally:
        comm.abort()


def test_a_changed_internal_is_reported_by_name():
    changed = [
        Internal("distributed.worker.Worker.gather_dep", "worker/receiver.py", "override",
                 ("worker", "keys"), exact=True),
        Internal("distributed.worker.Worker.no_such_method", "worker/receiver.py", "called"),
        Internal("distributed.worker.get_data_from_worker", "worker/receiver.py", "called",
                 ("rpc", "keys", "worker", "who", "renamed")),
        Internal("distributed.worker_state_machine.SecedeEvent", "worker/x.py", "built",
                 fields=("key", "gone_field")),
    ]  # fmt: skip
    with pytest.raises(UnsupportedDistributed) as info:
        check_internals(internals=changed)
    message = str(info.value)
    assert "Worker.gather_dep (used by dask_hoplite/worker/receiver.py: override): " in message
    assert "its parameters are ['worker', 'to_gather', 'total_nbytes', 'stimulus_id']" in message
    assert "Worker.no_such_method" in message and "it is gone" in message
    assert "; the transport turns off" in message  # the feature each one needs
    assert "dask-hoplite passes ['rpc', 'keys', 'worker', 'who', 'renamed']" in message
    assert "dask-hoplite uses ['key', 'gone_field']" in message
    with pytest.raises(UnsupportedDistributed, match="needs a live Worker"):
        rpc = next(i for i in PRIVATE_INTERNALS if i.path.endswith("Worker.rpc"))
        check_internals(internals=[rpc], complete=True)


def test_the_list_names_where_each_internal_is_used():
    for internal in PRIVATE_INTERNALS:
        path = os.path.join(ROOT, "dask_hoplite", internal.used_by)
        assert os.path.exists(path) or os.path.exists(path + ".py"), internal


def test_a_check_that_itself_fails_is_a_drift_not_a_crash():
    """A release that turns a dataclass into a plain class makes the field
    check raise; that internal is reported as drifted, nothing raises."""
    from dask_hoplite.compat import find_drifts

    not_a_dataclass = Internal(
        "distributed.worker.Worker", "worker/receiver.py", "built", fields=("key",)
    )
    (drift,) = find_drifts(internals=[not_a_dataclass])
    assert drift.internal == "distributed.worker.Worker" and drift.feature == "transport"
    assert "cannot be checked (TypeError" in drift.problem
