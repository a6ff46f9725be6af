"""Every notebook executes with its default (CPU) parameters, within its time budget, and is
committed clean. Chapter tests assert the values each notebook records (see conftest.glue)."""

import pytest

import harness
import repo_checks

NOTEBOOKS = [p.stem for p in harness.source_notebooks()]


def test_there_are_notebooks():
    assert "00-introduction" in NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_clean(name):
    assert repo_checks.notebook_problems(harness.NOTEBOOK_DIR / f"{name}.ipynb") == []


@pytest.mark.notebook
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_within_budget(name):
    path = harness.executed(name)
    seconds = harness.duration_s(path)
    print(f"{name}: {seconds:.1f} s (budget {harness.DEFAULT_BUDGET_S:.0f} s)")
    assert seconds <= harness.DEFAULT_BUDGET_S, f"{name} took {seconds:.0f} s"
