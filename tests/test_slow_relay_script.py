"""``benchmarks/slow_relay.py`` end to end on a small emulated cluster (real
namespaces, real processes, a real NIC cut to a quarter of its rate
mid-broadcast): hoplite judges the slowed relay, and only it, lagging; the
receiver below it and the relay itself each drop their stream once and
resume; every consumer sees the source's bytes, and the receivers below the
slowed relay finish before it. Needs root and iproute2 (CI has both);
skipped elsewhere."""

from __future__ import annotations

import pytest
from benchmark_scripts import emulated_cluster_marks, run_script

pytestmark = emulated_cluster_marks()


@pytest.mark.timeout(600)
def test_a_relay_slowed_mid_broadcast_is_routed_around(tmp_path):
    done, found = run_script(
        "slow_relay.py",
        str(tmp_path / "slow"),
        580,
        *("--workers", "5", "--rate-mbit", "100", "--size", "24MiB"),
        *("--relays", "2", "--at", "0.4", "--methods", "hoplite"),
    )
    (run,) = found
    assert run["ok"], run["note"]
    # w0 -> w1 -> w2 -> w3 -> w4; w2 slowed: judged once, after the cut.
    assert [host for _, host in run["judged"]] == ["w2"]
    assert run["judged"][0][0] > 0
    assert run["reroutes"] == 2  # w3 left w2, w2 left w1
    # Below the slowed relay, the chain no longer moves at its rate.
    assert max(run["finish"][k] for k in ("3", "4")) < run["finish"]["2"]
    assert "judged after" in done.stdout
