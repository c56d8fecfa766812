"""One owner for every reduction run (issue 41): the scheduler's reduction
coordinator is the only code that plans a reduction or places a broken tree
again. Read from the source with :mod:`ast`; nothing is imported or run."""

from __future__ import annotations

from module_imports import callers, modules

COORDINATOR = "dask_hoplite.scheduler.reduction_coordinator:ReductionCoordinator"


def test_the_planner_is_called_by_the_coordinator_only():
    assert callers("plan_reduction") == {f"{COORDINATOR}._plan"}


def test_a_broken_tree_is_placed_again_by_the_coordinator_only():
    assert callers("relocated_spec") == {f"{COORDINATOR}.replan_tree"}


def test_the_call_finder_sees_calls_at_every_depth(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("plan(1)\n")
    (pkg / "a.py").write_text(
        "class A:\n"
        "    async def run(self):\n"
        "        def inner():\n"
        "            return self.core.plan(2)\n"
        "        return inner\n"
        "def other():\n"
        "    return [plan(x) for x in ()]\n"
        "def not_a_call():\n"
        "    return plan\n"
    )
    assert callers("plan", modules(str(pkg), "pkg")) == {"pkg", "pkg.a:A.run.inner", "pkg.a:other"}
