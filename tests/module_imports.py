"""Static facts about the dask_hoplite source, read with :mod:`ast` (nothing is
imported or run): the modules, what each imports, and the size of every module,
class and function. Used by ``test_pure_core.py`` and ``test_structure.py``."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass

PACKAGE = "dask_hoplite"
PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def modules(root: str = PACKAGE_DIR, package: str = PACKAGE) -> dict[str, str]:
    """Every module below ``root``: dotted name -> path (``pkg`` for ``pkg/__init__.py``)."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        rel = os.path.relpath(dirpath, root)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for name in sorted(filenames):
            if name.endswith(".py"):
                mod = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                out[mod] = os.path.join(dirpath, name)
    return out


@dataclass(frozen=True)
class Import:
    module: str  # the module the statement names, or module.name for "from m import name"
    line: int


def imports(path: str, module: str, is_package: bool = False) -> Iterator[Import]:
    """Every import statement of a file, at any depth (``if TYPE_CHECKING:``
    blocks and function bodies included), with relative imports resolved.
    ``from m import n`` yields ``m.n`` (which may be a submodule or an attribute)."""
    tree = ast.parse(open(path).read(), path)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                yield Import(f"{base}.{alias.name}", node.lineno)


def internal_target(name: str, known: dict[str, str]) -> str | None:
    """The dask_hoplite module an imported name refers to: the longest known
    module that is ``name`` or a prefix of it (None: outside the package)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(known: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the dask_hoplite modules importing it runs: the ones it
    names, and the packages they are in (Python runs a package's
    ``__init__`` before any module of it), but for its own packages, which
    are running already when it is imported."""
    known = known or modules()
    graph: dict[str, set[str]] = {}
    for mod, path in known.items():
        own = _ancestors(mod) | {mod}
        targets = set()
        for imp in imports(path, mod, path.endswith("__init__.py")):
            t = internal_target(imp.module, known)
            if t is not None and t != mod:
                targets.add(t)
                targets |= {p for p in _ancestors(t) if p in known and p not in own}
        graph[mod] = targets
    return graph


def _ancestors(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@dataclass(frozen=True)
class Span:
    kind: str  # "module", "class" or "function"
    name: str  # module:Qualified.name
    lines: int


def spans(path: str, module: str) -> Iterator[Span]:
    """The length in lines of the module and of every class and function in it
    (nested ones included, decorators counted)."""
    source = open(path).read()
    yield Span("module", module, len(source.splitlines()))
    tree = ast.parse(source, path)

    def walk(node: ast.AST, prefix: str) -> Iterator[Span]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                assert child.end_lineno is not None
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                qual = f"{prefix}{child.name}"
                yield Span(kind, f"{module}:{qual}", child.end_lineno - start + 1)
                yield from walk(child, qual + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def callers(name: str, known: dict[str, str] | None = None) -> set[str]:
    """Where ``name`` is called, as ``module:Qualified.function`` of the
    enclosing function (``module`` for a call at module level): a call of the
    bare name or of an attribute of that name (``x.name(...)``)."""
    known = modules() if known is None else known
    out: set[str] = set()

    def walk(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = where
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                here = f"{where}.{child.name}" if ":" in where else f"{where}:{child.name}"
            elif isinstance(child, ast.Call):
                f = child.func
                if (isinstance(f, ast.Name) and f.id == name) or (
                    isinstance(f, ast.Attribute) and f.attr == name
                ):
                    out.add(where)
            walk(child, here)

    for mod, path in known.items():
        walk(ast.parse(open(path).read(), path), mod)
    return out


def climbs(graph: dict[str, set[str]], rank: dict[str, int]) -> list[list[str]]:
    """Every import path from a module to one of a higher ``rank``, directly or
    through other modules: one shortest path (a list of modules, importer
    first) per (module, higher module) pair."""
    out = []
    for start in sorted(graph):
        paths = {start: [start]}
        queue = [start]
        while queue:
            here = queue.pop(0)
            for nxt in sorted(graph.get(here, ())):
                if nxt not in paths:
                    paths[nxt] = [*paths[here], nxt]
                    queue.append(nxt)
        out += [
            path for end, path in sorted(paths.items()) if rank.get(end, 0) > rank.get(start, 0)
        ]
    return out
