"""Sphinx extension: the configuration reference, generated from
``dask_hoplite/hoplite.yaml`` (the single place each setting is defined and
documented) into ``configuration-reference.md`` before every build.

Each key's text is the comment block just above it; a comment block followed
by a blank line and then a section heading documents the section."""

from __future__ import annotations

import pathlib
import re

import yaml

KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_-]+):(?P<value>.*)$")


def reference(yaml_path: pathlib.Path) -> str:
    lines = yaml_path.read_text().splitlines()
    defaults = yaml.safe_load("\n".join(lines))
    out = [
        "# Configuration reference",
        "",
        "Every setting of dask-hoplite, under `hoplite` in `dask.config`, with its default and",
        "what it does, generated from `dask_hoplite/hoplite.yaml`. Set them the usual Dask",
        "ways, on the scheduler and on every worker: a YAML file in `~/.config/dask/`,",
        '`dask.config.set({"hoplite.min-bytes": "4 MiB"})` before the cluster starts, or the',
        'environment (`DASK_HOPLITE__MIN_BYTES="4 MiB"`).',
        "",
        "## `hoplite`",
        "",
        "The top-level settings.",
        "",
    ]
    comment: list[str] = []
    path: list[tuple[int, str]] = []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        if not stripped:
            comment = [] if not path else comment
            continue
        m = KEY.match(line)
        if not m:
            continue
        indent = len(m["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, m["key"]))
        name = ".".join(k for _, k in path)
        value = m["value"].strip()
        if not value:  # a section
            if len(path) > 1:
                out += [f"## `{name}`", ""]
                if comment:
                    out += [" ".join(comment), ""]
        else:
            node = defaults
            for _, k in path:
                node = node[k]
            out += [f"### `{name}`", "", f"Default: `{node}`", ""]
            if comment:
                out += [" ".join(comment), ""]
        comment = []
    return "\n".join(out) + "\n"


def _generate(app) -> None:  # type: ignore[no-untyped-def]
    src = pathlib.Path(app.srcdir)
    text = reference(src.parent / "dask_hoplite" / "hoplite.yaml")
    target = src / "configuration-reference.md"
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("builder-inited", _generate)
    return {"parallel_read_safe": True}
