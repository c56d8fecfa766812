"""``benchmarks/scaling.py`` end to end on small emulated clusters (real
namespaces, real processes): a run of one configuration and a run of several
(one process each) both write their rows and exit 0. Needs root and iproute2
(CI has both); skipped elsewhere."""

from __future__ import annotations

import pytest
from benchmark_scripts import emulated_cluster_marks, run_script

pytestmark = emulated_cluster_marks()


def _run(tmp_path, *configs):
    return run_script(
        "scaling.py",
        str(tmp_path / "scaling"),
        600,
        *("--configs", *configs, "--collectives", "broadcast", "--broadcast-methods", "hoplite"),
        *("--size", "8MiB", "--reps", "1"),
    )


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
