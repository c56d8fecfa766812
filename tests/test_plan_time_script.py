"""``benchmarks/plan_time.py`` end to end on a small cluster: it times the
scheduler's planning calls and says what it planned."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import plan_time  # noqa: E402


def test_the_script_times_each_plan_on_the_scheduler(capsys):
    assert plan_time.main(["--inputs", "16", "--workers", "2", "--reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "16 inputs on 2 workers, plan tree" in out
    assert len(out.split("in it):")[1].splitlines()[0].split()) == 3  # one time per call
