"""The harness's own checks catch the defects they exist for."""

import json
import shutil

import nbformat
import pytest

import harness
import repo_checks
from harness import ROOT


def _notebook(tmp_path, *, outputs=False, tagged=True):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("x = 1")
    if tagged:
        cell.metadata["tags"] = ["parameters"]
    if outputs:
        cell.outputs = [nbformat.v4.new_output("stream", text="1\n")]
        cell.execution_count = 1
    nb.cells = [cell]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_clean_notebook_passes(tmp_path):
    assert repo_checks.notebook_problems(_notebook(tmp_path)) == []


def test_notebook_with_outputs_fails(tmp_path):
    problems = repo_checks.notebook_problems(_notebook(tmp_path, outputs=True))
    assert any("outputs" in p for p in problems) and any("execution count" in p for p in problems)


def test_notebook_without_parameters_cell_fails(tmp_path):
    assert any("parameters" in p for p in repo_checks.notebook_problems(_notebook(tmp_path, tagged=False)))


def test_environment_drift_is_detected(tmp_path):
    env = (ROOT / "environment.yml").read_text().replace("      - peft>=0.13\n", "")
    (tmp_path / "environment.yml").write_text(env + "      - scipy\n")
    drift = repo_checks.environment_drift(ROOT / "pyproject.toml", tmp_path / "environment.yml")
    assert drift == {"only_in_pyproject": {"peft>=0.13"}, "only_in_environment": {"scipy"}}


@pytest.mark.notebook
def test_glue_reading_and_failure(tmp_path):
    """Executes a two-cell notebook: reads what it glued, and a failing cell raises."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    params = nbformat.v4.new_code_cell("value = 2")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import numpy as np\nfrom dschat_lib import book\n"
        "book.record('answer', np.float64(value) * 21)\nbook.record('name', 'zero')")]
    src = tmp_path / "glued.ipynb"
    nbformat.write(nb, str(src))
    out = harness.execute(src, tmp_path / "out" / "glued.ipynb", parameters={"value": 3})
    assert harness.read_glue(out) == {"answer": 63.0, "name": "zero"}
    assert harness.duration_s(out) > 0

    nb.cells.append(nbformat.v4.new_code_cell("raise ValueError('boom')"))
    nbformat.write(nb, str(src))
    import papermill
    with pytest.raises(papermill.PapermillExecutionError, match="boom"):
        harness.execute(src, tmp_path / "out" / "failing.ipynb")
    assert not (tmp_path / "out" / "failing.ipynb").exists()   # no half-run copy looks fresh
    assert (tmp_path / "out" / "failing.ipynb.failed.ipynb").exists()


def test_stale_executed_copy_is_detected(tmp_path):
    src = _notebook(tmp_path)
    dst = tmp_path / "executed.ipynb"
    shutil.copy(src, dst)
    import os
    os.utime(src, (dst.stat().st_mtime + 10,) * 2)     # the source changed after execution
    assert not harness.is_fresh(src, dst)
