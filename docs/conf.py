"""Sphinx configuration of dask-hoplite's documentation.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (CI does, with
warnings as errors)."""

from __future__ import annotations

import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE / "_ext"))

import dask_hoplite  # noqa: E402

project = "dask-hoplite"
author = "the dask-hoplite developers"
copyright = "2026, the dask-hoplite developers"
release = version = dask_hoplite.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "config_reference",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_numpy_docstring = True
html_theme = "alabaster"
html_static_path = ["_static"]
html_title = f"dask-hoplite {release}"
