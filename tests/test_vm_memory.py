"""The benchmarks' VM keeps freed memory while an emulated cluster runs
(``benchmarks/vm_memory.py``): the kernel's reporting threshold is raised and
put back as it was, by the last of overlapping clusters, and nothing changes
where the knob is missing or cannot be written. The knob here is a file of
the test's own standing in for the sysfs one."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import vm_memory  # noqa: E402
from benchmarks.vm_memory import KeptFreedMemory  # noqa: E402


def knob(tmp_path, value="9"):
    path = tmp_path / "page_reporting_order"
    path.write_text(value + "\n")
    return str(path)


def read(path):
    with open(path) as f:
        return f.read().strip()


def test_reporting_is_off_while_held_and_restored_after(tmp_path, monkeypatch):
    monkeypatch.delenv(vm_memory.ENV, raising=False)
    path = knob(tmp_path)
    with KeptFreedMemory(path) as kept:
        assert kept.active and kept.why == ""
        assert read(path) == str(vm_memory.NEVER)
    assert not kept.active
    assert read(path) == "9"
    kept.stop()  # again: nothing to undo
    assert read(path) == "9"


def test_overlapping_clusters_restore_what_the_first_found(tmp_path, monkeypatch):
    monkeypatch.delenv(vm_memory.ENV, raising=False)
    path = knob(tmp_path)
    first, second = KeptFreedMemory(path), KeptFreedMemory(path)
    first.start()
    second.start()
    first.stop()  # the second still runs: reporting stays off
    assert read(path) == str(vm_memory.NEVER)
    second.stop()
    assert read(path) == "9"
    assert path not in vm_memory._HELD


def test_nothing_changes_without_the_knob_or_when_asked_to_keep(tmp_path, monkeypatch):
    monkeypatch.delenv(vm_memory.ENV, raising=False)
    missing = KeptFreedMemory(str(tmp_path / "absent"))
    missing.start()
    assert not missing.active and "does not exist" in missing.why
    unwritable = KeptFreedMemory(str(tmp_path))  # a directory: open() fails
    unwritable.start()
    assert not unwritable.active and "left on" in unwritable.why
    path = knob(tmp_path)
    monkeypatch.setenv(vm_memory.ENV, "keep")
    with KeptFreedMemory(path) as kept:
        assert not kept.active and "keep" in kept.why
        assert read(path) == "9"


def test_a_knob_left_off_by_a_killed_run_is_restored_to_the_default(tmp_path, monkeypatch):
    """A run killed before its teardown leaves reporting off; the next one
    puts the kernel's default back when it ends, not the value it found."""
    monkeypatch.delenv(vm_memory.ENV, raising=False)
    path = knob(tmp_path, str(vm_memory.NEVER))
    with KeptFreedMemory(path) as kept:
        assert kept.active
        assert read(path) == str(vm_memory.NEVER)
    assert read(path) == str(vm_memory.DEFAULT_ORDER)
