"""The sans-IO core stays sans-IO: no module of ``dask_hoplite.core`` (nor the
errors module it raises from, nor the pure halves of graph reductions:
recognising aggregates and rewriting the graph) imports asyncio, tornado or
distributed, or any dask_hoplite module that is not itself pure. Read statically, so an import
inside ``if TYPE_CHECKING:`` or a function body counts too."""

from __future__ import annotations

from module_imports import PACKAGE, imports, internal_target, modules

FORBIDDEN = ("asyncio", "tornado", "distributed")


#: Pure modules outside ``core``: they live with the I/O shells of their feature.
PURE_ELSEWHERE = ("errors", "graph_reductions.recognize", "graph_reductions.rewrite")


def pure_modules(known: dict[str, str]) -> set[str]:
    elsewhere = {f"{PACKAGE}.{m}" for m in PURE_ELSEWHERE}
    return {m for m in known if m.startswith(f"{PACKAGE}.core") or m in elsewhere}


def violations(known: dict[str, str]) -> list[str]:
    """One line per import that breaks the rule, naming the module and line."""
    pure = pure_modules(known)
    out = []
    for mod in sorted(pure):
        path = known[mod]
        for imp in imports(path, mod, path.endswith("__init__.py")):
            root = imp.module.split(".")[0]
            target = internal_target(imp.module, known)
            if root in FORBIDDEN:
                out.append(f"{mod}:{imp.line} imports {imp.module}")
            elif root == PACKAGE and target not in pure:
                out.append(f"{mod}:{imp.line} imports {imp.module}, which is not pure")
    return out


def test_the_core_imports_no_io():
    known = modules()
    assert f"{PACKAGE}.core.directory" in known and f"{PACKAGE}.core.tree_shape" in known
    assert {f"{PACKAGE}.{m}" for m in PURE_ELSEWHERE} <= pure_modules(known)
    assert violations(known) == []


def test_the_check_catches_an_io_import(tmp_path):
    """The rule above fails when a core module imports asyncio, tornado,
    distributed (also under TYPE_CHECKING or in a function), or an impure
    dask_hoplite module."""
    core = tmp_path / PACKAGE / "core"
    core.mkdir(parents=True)
    (tmp_path / PACKAGE / "__init__.py").write_text("")
    (tmp_path / PACKAGE / "errors.py").write_text("")
    (tmp_path / PACKAGE / "streams.py").write_text("import tornado\n")
    (core / "__init__.py").write_text("")
    (core / "clean.py").write_text("import math\nfrom dask_hoplite.errors import X\n")
    (core / "loop.py").write_text("import asyncio.tasks\n")
    (core / "hinted.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distributed import Worker\n"
    )
    (core / "late.py").write_text("def f():\n    from tornado.ioloop import IOLoop\n")
    (core / "shell.py").write_text("from ..streams import connect\n")
    found = violations(modules(str(tmp_path / PACKAGE), PACKAGE))
    assert found == [
        f"{PACKAGE}.core.hinted:3 imports distributed.Worker",
        f"{PACKAGE}.core.late:2 imports tornado.ioloop.IOLoop",
        f"{PACKAGE}.core.loop:1 imports asyncio.tasks",
        f"{PACKAGE}.core.shell:1 imports {PACKAGE}.streams.connect, which is not pure",
    ]
