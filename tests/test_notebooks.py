"""The research notebooks run top to bottom on the tiny fixture pair (code cells executed in order, as a kernel
would, with a non-interactive matplotlib backend). Outputs are stripped in git; this checks that too."""

from __future__ import annotations

import os

import matplotlib
import nbformat
import pytest

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "notebooks")
ALL = sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb"))


def test_there_are_notebooks():
    assert {"tree_anatomy.ipynb", "acceptance_vs_budget.ipynb", "kernels_and_performance.ipynb",
            "train_a_drafter.ipynb"} <= set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_notebook_runs(name, monkeypatch):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("DDTREE_NOTEBOOK_PAIR", "fixture")
    monkeypatch.chdir(NOTEBOOKS)
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    nbformat.validate(nb)
    namespace: dict = {"__name__": "__main__"}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        assert not cell.get("outputs") and cell.get("execution_count") is None, f"{name}: cell {i} has outputs"
        try:
            exec(compile(cell.source, f"{name}[{i}]", "exec"), namespace)
        except Exception as e:  # name the cell
            raise AssertionError(f"{name}: cell {i} failed: {type(e).__name__}: {e}") from e
    assert plt.get_fignums(), f"{name} drew nothing"
    plt.close("all")
