"""What the test suite reaches and imports, read with :mod:`ast` (nothing is
imported or run), so that a test can check that every third-party module it
needs is declared in the project's ``test`` extra.

The suite reaches a file when a test module imports it (``benchmarks.x``, an
example module on ``sys.path``, a helper beside the tests), or names it as a
script to run (a string ``"x.py"`` for a file in ``examples/`` or
``benchmarks/``), and so on from every file reached. The package itself is
reached whole: the tests import it. ``pytest.importorskip("m")`` counts as an
import of ``m``: a skip would otherwise hide a missing declaration. Used by
``test_packaging.py``."""

from __future__ import annotations

import ast
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from module_imports import imports

#: Folders whose modules the suite imports by dotted name from the root.
PACKAGES = ("dask_hoplite", "benchmarks")
#: Folders whose modules are imported by bare name (they are put on sys.path)
#: and whose scripts the tests run by file name.
SCRIPT_DIRS = ("tests", "examples", "benchmarks")


@dataclass(frozen=True)
class Use:
    """A third-party module named by a reached file."""

    top: str  # the top-level import name, e.g. "matplotlib"
    path: str  # relative to the root
    line: int


def _module_name(root: str, path: str) -> tuple[str, bool]:
    rel = os.path.relpath(path, root)[: -len(".py")].split(os.sep)
    is_package = rel[-1] == "__init__"
    if is_package:
        rel = rel[:-1]
    if rel[0] in PACKAGES:
        return ".".join(rel), is_package
    return rel[-1], is_package  # a bare-name module: tests/, examples/


def _local_files(root: str, name: str) -> list[str]:
    """The files of the checkout an imported dotted name refers to: the module
    and every package on its way (their ``__init__`` runs too)."""
    parts = name.split(".")
    found: list[str] = []
    if parts[0] in PACKAGES:
        for i in range(1, len(parts) + 1):
            base = os.path.join(root, *parts[:i])
            for candidate in (os.path.join(base, "__init__.py"), base + ".py"):
                if os.path.isfile(candidate):
                    found.append(candidate)
        return found
    for folder in SCRIPT_DIRS:
        candidate = os.path.join(root, folder, parts[0] + ".py")
        if os.path.isfile(candidate):
            found.append(candidate)
    return found


def _named_scripts(root: str, tree: ast.AST) -> Iterator[str]:
    """Files in a script folder that a string constant names (``"x.py"``, or a
    path ending in it)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            base = os.path.basename(node.value)
            if base.endswith(".py"):
                for folder in SCRIPT_DIRS:
                    candidate = os.path.join(root, folder, base)
                    if os.path.isfile(candidate):
                        yield candidate


def _skipped_imports(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """``pytest.importorskip("m")`` calls: module name and line."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def reached(root: str) -> dict[str, list[tuple[str, int]]]:
    """Every file the suite reaches -> the modules it imports (name, line)."""
    todo = [
        os.path.join(root, "tests", f)
        for f in sorted(os.listdir(os.path.join(root, "tests")))
        if f.endswith(".py")
    ]
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "dask_hoplite")):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        todo += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    out: dict[str, list[tuple[str, int]]] = {}
    while todo:
        path = os.path.normpath(todo.pop())
        if path in out:
            continue
        tree = ast.parse(open(path).read(), path)
        module, is_package = _module_name(root, path)
        names = [(imp.module, imp.line) for imp in imports(path, module, is_package)]
        names += list(_skipped_imports(tree))
        out[path] = names
        for name, _ in names:
            todo += _local_files(root, name)
        todo += _named_scripts(root, tree)
    return out


def third_party(root: str) -> list[Use]:
    """The uses of modules that are neither the standard library's nor the
    checkout's, in every file the suite reaches."""
    uses = []
    for path, names in sorted(reached(root).items()):
        for name, line in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or _local_files(root, top):
                continue
            uses.append(Use(top, os.path.relpath(path, root), line))
    return uses
