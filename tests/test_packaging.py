"""What the package declares matches what it does: the distributed range it
accepts, the modules it imports, one version."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import dask_hoplite
from dask_hoplite.compat import TESTED_RANGE

tomllib = pytest.importorskip("tomllib")

ROOT = pathlib.Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
#: Import names of the distributions that differ from them.
IMPORT_NAME = {"pyyaml": "yaml"}


def requirements():
    return {Requirement(r).name.lower(): Requirement(r) for r in PROJECT["dependencies"]}


def test_the_dask_and_distributed_ranges_are_the_ones_compat_accepts():
    low, high = TESTED_RANGE
    for name in ("dask", "distributed"):
        spec = requirements()[name].specifier
        assert low in spec and Version(str(high)) not in spec, (name, spec)
        # Every release the range admits is one compat accepts, and back.
        for v in ("2026.8.0", "2026.8.1", "2026.8.9"):
            assert (Version(v) in spec) == (low <= Version(v) < high), (name, v)
        assert Version("2026.7.9") not in spec and Version("2026.9.0") not in spec


def _third_party_imports():
    found = set()
    for path in (ROOT / "dask_hoplite").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "dask_hoplite":
                    found.add(top)
    return found


def test_what_is_imported_is_declared_and_nothing_else():
    declared = {IMPORT_NAME.get(n, n) for n in requirements()}
    extras = {
        IMPORT_NAME.get(Requirement(r).name.lower(), Requirement(r).name.lower())
        for r in PROJECT["optional-dependencies"]["dashboard"]
    }
    imported = _third_party_imports()
    # bokeh and prometheus_client are imported only where they are used, and
    # their absence is handled: they are the "dashboard" extra.
    assert imported - declared == extras
    assert declared <= imported


def test_the_version_is_defined_once():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    # The installed distribution took its version from the package.
    assert importlib.metadata.version("dask-hoplite") == dask_hoplite.__version__
