"""The maps of the house match the house: every package's ``__init__``
docstring names each of its modules, and the module table of
``docs/design.md`` has a row for every module of the package, and none for a
module that is gone."""

from __future__ import annotations

import ast
import os
import re

import pytest
from module_imports import PACKAGE, PACKAGE_DIR, modules

DESIGN = os.path.join(os.path.dirname(PACKAGE_DIR), "docs", "design.md")
SUBPACKAGES = sorted(m for m, p in modules().items() if p.endswith("__init__.py") and m != PACKAGE)


def _named_in_docstring(package: str) -> set[str]:
    """The modules the package's docstring names with ``:mod:``."""
    doc = ast.get_docstring(ast.parse(open(modules()[package]).read())) or ""
    out = set()
    for ref in re.findall(r":mod:`~?([\w.]+)`", doc):
        out.add(package + ref if ref.startswith(".") else ref)
    return out


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_each_package_docstring_names_all_its_modules(package):
    mine = {m for m in modules() if m.rpartition(".")[0] == package}
    named = {m for m in _named_in_docstring(package) if m.rpartition(".")[0] == package}
    assert sorted(mine - named) == [], "modules the map leaves out"
    assert sorted(named - mine) == [], "names in the map that are no module"


def _design_rows() -> set[str]:
    """The files named in the first column of design.md's module table."""
    rows = set()
    for line in open(DESIGN):
        if line.startswith("| `"):
            first = line.split("|")[1]
            rows |= set(re.findall(r"`([\w/.]+)`", first))
    return rows


def _only_a_docstring(path: str) -> bool:
    body = ast.parse(open(path).read()).body
    return len(body) == 1 and isinstance(body[0], ast.Expr)


def test_the_design_table_has_a_row_for_every_module():
    files = {
        os.path.relpath(p, PACKAGE_DIR).replace(os.sep, "/")
        for m, p in modules().items()
        # a subpackage's __init__ that holds only its map needs no row
        if m == PACKAGE or not (p.endswith("__init__.py") and _only_a_docstring(p))
    }
    files |= {"hoplite.yaml"}
    rows = _design_rows()
    assert sorted(files - rows) == [], "modules design.md leaves out"
    assert sorted(rows - files) == [], "rows of design.md for no module"
