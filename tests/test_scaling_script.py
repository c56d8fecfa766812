"""``benchmarks/scaling.py`` end to end on small emulated clusters (real
namespaces, real processes): a run of one configuration and a run of several
(one process each) both write their rows and exit 0. Needs root and iproute2
(CI has both); skipped elsewhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import emulation  # noqa: E402

ok, why = emulation.available()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why or "")]


def _run(tmp_path, *configs):
    out = str(tmp_path / "scaling")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--configs", *configs]
    cmd += ["--collectives", "broadcast", "--broadcast-methods", "hoplite"]
    cmd += ["--size", "8MiB", "--reps", "1", "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out + ".json") as f:
        rows = json.load(f)
    return done, rows


@pytest.mark.timeout(700)
@pytest.mark.parametrize("configs", [("2x1@1000",), ("2x1@1000", "3x1@1000")])
def test_a_scaling_run_writes_a_row_per_configuration_and_exits_0(tmp_path, configs):
    done, rows = _run(tmp_path, *configs)
    assert "failed or missing configurations" not in done.stderr
    assert len(rows) == len(configs), rows
    table = done.stdout
    for config in configs:
        hosts = config.split("x")[0]
        assert any(line.split()[:2] == ["broadcast", hosts] for line in table.splitlines()), table
