"""What the package declares matches what it does: the distributed range it
accepts, the modules it imports, one version."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import re
import sys

import suite_imports
from packaging.requirements import Requirement
from packaging.version import Version

import dask_hoplite
from dask_hoplite.compat import TESTED_RANGE

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a package (the test extra's tomli)
    import tomli as tomllib

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
        # The oldest tested release is the lower bound; newer ones install
        # (the plugin warns that they are untested), older ones do not.
        assert low in spec and high in spec, (name, spec)
        for v in (str(low), str(high), "2026.9.0", "2027.1.0"):
            assert Version(v) in spec, (name, v)
        for v in ("2025.1.0", f"{low.major}.{low.minor - 1}.9" if low.minor > 1 else "2025.12.9"):
            assert Version(v) not in spec, (name, v)
        assert not any(s.operator in ("<", "<=", "==", "~=") for s in spec), spec


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


#: Benchmarks that run a peer framework, each with the extra that declares it.
#: The suite reads their tables (``benchmarks/peers.py``) but never runs them.
#: Test modules of an optional extra (the suite skips them without it).
OPTIONAL_TESTS = {"tests/test_torch.py": "torch", "examples/async_sgd_torch.py": "torch"}
PEER_SCRIPTS = {
    "benchmarks/mpi_peers.py": "mpi",
    "benchmarks/ray_peer.py": "peers",
    "benchmarks/gloo_peer.py": "peers",
}


def _import_names(requirement_lines):
    """The top-level import names of the distributions required."""
    provides: dict[str, set[str]] = {}
    for top, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(_normalise(dist), set()).add(top)
    names = set()
    for line in requirement_lines:
        dist = _normalise(Requirement(line).name)
        names |= provides.get(dist) or {IMPORT_NAME.get(dist, dist.replace("-", "_"))}
    return names


def _normalise(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _undeclared(root: pathlib.Path, project: dict) -> list[str]:
    extras = project["optional-dependencies"]
    suite = _import_names([*project["dependencies"], *extras["test"]])
    out = []
    for use in suite_imports.third_party(str(root)):
        path = use.path.replace(os.sep, "/")
        extra = PEER_SCRIPTS.get(path) or OPTIONAL_TESTS.get(path)
        declared = suite | _import_names(extras[extra]) if extra else suite
        if use.top not in declared:
            where = f"the {extra!r} or 'test' extra" if extra else "the 'test' extra"
            out.append(f"{use.path}:{use.line} imports {use.top!r}, not declared in {where}")
    return sorted(set(out))


def test_every_module_the_suite_imports_is_declared_in_the_test_extra():
    """The suite runs in a fresh virtualenv with ``.[test]`` only (ci/test.sh):
    a module that a test, the package, or an example or benchmark the tests
    import or run needs must come with that extra, not from whatever the
    machine had before."""
    assert _undeclared(ROOT, PROJECT) == []


def test_an_undeclared_import_in_a_script_the_suite_runs_is_reported(tmp_path):
    """The check above can fail: a script a test runs by name, importing a
    module nobody declared, and a test skipping on another."""
    for folder in ("tests", "examples", "benchmarks", "dask_hoplite"):
        (tmp_path / folder).mkdir()
    (tmp_path / "dask_hoplite" / "__init__.py").write_text("import numpy\n")
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "examples" / "plot.py").write_text("def f():\n    import matplotlib\n")
    (tmp_path / "examples" / "lonely.py").write_text("import also_not_reached\n")
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n"
        "from benchmarks import unused as _\n"
        "RUN = ['python', 'plot.py']\n"
        "def test():\n    pytest.importorskip('selenium')\n"
    )
    (tmp_path / "benchmarks" / "unused.py").write_text("import json\n")
    project = {"dependencies": ["numpy"], "optional-dependencies": {"test": ["pytest"]}}
    assert _undeclared(tmp_path, project) == [
        "examples/plot.py:2 imports 'matplotlib', not declared in the 'test' extra",
        "tests/test_x.py:5 imports 'selenium', not declared in the 'test' extra",
    ]
    project["optional-dependencies"]["test"] += ["matplotlib", "selenium"]
    assert _undeclared(tmp_path, project) == []
