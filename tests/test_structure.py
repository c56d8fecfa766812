"""The house stays livable: no import cycle among dask_hoplite's modules
(imports under ``if TYPE_CHECKING:`` and in function bodies count, and so does
the package ``__init__`` an import runs), and every module says why it exists
in a docstring. Sizes are not tested: a module with one job may be long; the
largest rooms are listed at the end of every pytest run (``conftest.py``), a
hint of where a seam may be."""

from __future__ import annotations

import ast

from module_imports import cycles, import_graph, modules


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_a_cycle_through_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (pkg / "c.py").write_text("from . import a\n")
    known = modules(str(pkg), "pkg")
    assert cycles(import_graph(known)) == [["pkg.a", "pkg.b"]]


def test_the_cycle_check_sees_a_cycle_through_a_package_init(tmp_path):
    """Importing ``pkg.s.other`` runs ``pkg/s/__init__.py`` first: when that
    imports a module which imports back, the import is a cycle."""
    pkg = tmp_path / "pkg"
    (pkg / "s").mkdir(parents=True)
    (pkg / "d").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "s" / "__init__.py").write_text("from pkg.s.plugin import P\n")
    (pkg / "s" / "plugin.py").write_text("from pkg.d.live import L\n")
    (pkg / "s" / "other.py").write_text("")
    (pkg / "d" / "__init__.py").write_text("")
    (pkg / "d" / "live.py").write_text("from pkg.s.other import O\n")
    known = modules(str(pkg), "pkg")
    assert cycles(import_graph(known)) == [["pkg.d.live", "pkg.s", "pkg.s.plugin"]]
    # A module's own package is running already: no edge to it.
    (pkg / "s" / "__init__.py").write_text("")
    (pkg / "s" / "plugin.py").write_text("from pkg.s.other import O\n")
    assert cycles(import_graph(modules(str(pkg), "pkg"))) == []


def test_every_module_has_a_docstring():
    missing = [
        mod
        for mod, path in modules().items()
        if not ast.get_docstring(ast.parse(open(path).read())) and not mod.endswith("_version")
    ]
    assert missing == []
