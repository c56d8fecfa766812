"""The emulated cluster the benchmarks and the demo rely on: namespaces,
rate limits, Dask inside them, and a teardown that leaves nothing behind.
Needs root and iproute2 (CI has both); skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import emulation  # noqa: E402

ok, why = emulation.available()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(not ok, reason=why or "")]


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.timeout(240)
def test_emulated_cluster_runs_hoplite_and_tears_down():
    before = namespaces()
    code = r"""
import numpy as np
from distributed import Client, wait
import dask_hoplite
from dask_hoplite.compat import worker_addresses
c = Client(ADDR)
c.register_plugin(dask_hoplite.Hoplite())
ws = worker_addresses(c)
x = c.submit(np.arange, 2_000_000, workers=[ws[0]])
wait(x)
got = c.gather([c.submit(lambda a, i: int(a.sum()), x, i, workers=[w], pure=False)
                for i, w in enumerate(ws[1:])])
info = c.run(lambda dask_worker: dask_worker.plugins["hoplite-worker"].stats.get("keys-received", 0))
print(got == [int(np.arange(2_000_000).sum())] * 2, sum(info.values()))
"""
    with emulation.EmulatedCluster(3, rate_mbit=200) as ec:
        made = namespaces() - before
        assert len(made) == 5  # switch, scheduler host, 3 worker hosts
        ec.start_dask()
        tx0 = ec.nic_bytes("w0")[0]
        out = ec.run_in_client(
            [sys.executable, "-c", code.replace("ADDR", repr(ec.scheduler_address))]
        )
        assert out.split() == ["True", "2"]
        # The source's NIC sent one copy (16 MB) plus protocol chatter, not two.
        sent = ec.nic_bytes("w0")[0] - tx0
        assert 16_000_000 <= sent < 1.5 * 16_000_000
        pids = ec.pids()
        assert pids
    assert namespaces() == before
    for pid in pids:
        assert (
            not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        )


def test_rejects_nonsense_sizes():
    with pytest.raises(ValueError, match="n_workers"):
        emulation.EmulatedCluster(0)


def test_the_vm_keeps_freed_memory_while_a_cluster_runs():
    """Where the VM reports freed memory to its hypervisor, an emulated
    cluster turns that off while it runs and puts it back after
    (``benchmarks/vm_memory.py``)."""
    from benchmarks import vm_memory

    if not os.path.exists(vm_memory.KNOB):
        pytest.skip("this machine has no free page reporting")
    before = open(vm_memory.KNOB).read().strip()
    with emulation.EmulatedCluster(1) as ec:
        if os.environ.get(vm_memory.ENV, "").lower() == "keep":
            assert not ec.memory.active
        else:
            assert ec.memory.active, ec.memory.why
            assert open(vm_memory.KNOB).read().strip() == str(vm_memory.NEVER)
    assert open(vm_memory.KNOB).read().strip() == before
