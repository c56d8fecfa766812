"""The house stays livable: no import cycle among dask_hoplite's modules
(imports under ``if TYPE_CHECKING:`` and in function bodies count), no module
over 500 lines, no class over 400, no function over 80, and every module says
why it exists in a docstring."""

from __future__ import annotations

import ast

from module_imports import cycles, import_graph, modules, spans

LIMITS = {"module": 500, "class": 400, "function": 80}


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


def test_no_module_class_or_function_is_too_long():
    too_long = [
        f"{sp.kind} {sp.name}: {sp.lines} lines (at most {LIMITS[sp.kind]})"
        for mod, path in modules().items()
        for sp in spans(path, mod)
        if sp.lines > LIMITS[sp.kind]
    ]
    assert too_long == []


def test_every_module_has_a_docstring():
    missing = [
        mod
        for mod, path in modules().items()
        if not ast.get_docstring(ast.parse(open(path).read())) and not mod.endswith("_version")
    ]
    assert missing == []
