"""Running a script of ``benchmarks/`` end to end from a test: in a
subprocess from the repository's root, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(
    script: str, out: str, timeout: float, *args: str
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``benchmarks/<script>`` with ``args`` and ``--out out``: the finished
    process (it must have exited 0) and the JSON it wrote to ``out.json``."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--out", out]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out + ".json") as f:
        return done, json.load(f)
