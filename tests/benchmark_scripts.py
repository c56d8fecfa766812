"""Running a script of ``benchmarks/`` end to end from a test: in a
subprocess from the repository's root, as a user runs it; and the marks of
a test that does so on an emulated cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def emulated_cluster_marks() -> list[pytest.MarkDecorator]:
    """``pytestmark`` of a test module that runs a script on an emulated
    cluster: ``netns`` and ``slow``, skipped where namespaces cannot be built
    (it needs root and iproute2; CI has both)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from benchmarks import emulation

    ok, why = emulation.available()
    return [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(not ok, reason=why or "")]


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
