"""The reversible replacements every override of a Dask internal is made of
(``dask_hoplite/patching.py``): each undoes exactly itself, once, and never
someone else's replacement made after it."""

from __future__ import annotations

from dask_hoplite.patching import AttributePatch, ItemPatch


class Worker:
    def gather_dep(self):
        return "dask's"


def test_an_attribute_patch_shows_the_class_method_again_when_undone():
    w = Worker()
    p = AttributePatch(w, "gather_dep", lambda: "hoplite's")
    assert w.gather_dep() == "hoplite's"
    p.undo()
    assert w.gather_dep() == "dask's" and "gather_dep" not in vars(w)
    p.undo()  # again: nothing
    assert w.gather_dep() == "dask's"


def test_an_undo_leaves_a_replacement_made_after_it():
    w = Worker()
    ours = AttributePatch(w, "gather_dep", lambda: "hoplite's")
    w.gather_dep = lambda: "another plugin's"  # wrapped ours, say
    ours.undo()
    assert w.gather_dep() == "another plugin's"
    handlers = {"gather": "dask's"}
    item = ItemPatch(handlers, "gather", "hoplite's")
    handlers["gather"] = "another plugin's"
    item.undo()
    assert handlers == {"gather": "another plugin's"}


def test_an_item_patch_restores_or_removes_the_entry():
    handlers = {"gather": "dask's"}
    replaced = ItemPatch(handlers, "gather", "hoplite's")
    added = ItemPatch(handlers, "hoplite_stream", "hoplite's")
    assert handlers == {"gather": "hoplite's", "hoplite_stream": "hoplite's"}
    added.undo()
    replaced.undo()
    assert handlers == {"gather": "dask's"}
