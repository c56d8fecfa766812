"""``docs/benchmarks.md`` is a results page built from ``benchmarks/results``:
its tables are up to date with the JSON, and it stays a page a user reads."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import results_page  # noqa: E402


def test_the_page_is_built_from_the_results_as_they_are():
    with open(results_page.PAGE) as f:
        page = f.read()
    assert results_page.render(page) == page, "run python benchmarks/results_page.py"


def test_the_page_is_short_and_every_figure_names_its_command():
    with open(results_page.PAGE) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 350
    for fig in results_page.FIGURES:
        assert any(fig.command in line and fig.file in line for line in lines), fig.label


def test_p90_is_the_nearest_rank():
    ten = [float(i) for i in range(1, 11)]
    assert results_page.p(ten, 0.9) == 9.0 and results_page.p(ten, 0.5) == 5.0
    assert results_page.p([1.0, 2.0, 3.0], 0.9) == 3.0  # 3 reps: the max
