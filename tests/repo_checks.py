"""Checks on the repository itself, written as functions so that tests/test_harness.py can
show each one catching a real defect (a check that cannot fail would prove nothing)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import yaml


def notebook_problems(path: Path) -> list[str]:
    """Why a committed notebook is not clean: outputs, execution counts, no parameters cell."""
    notebook = json.loads(Path(path).read_text())
    problems = []
    code_cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    for index, cell in enumerate(code_cells):
        if cell.get("outputs"):
            problems.append(f"{path.name}: code cell {index} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"{path.name}: code cell {index} has an execution count")
    if not code_cells or "parameters" not in code_cells[0].get("metadata", {}).get("tags", []):
        problems.append(f"{path.name}: the first code cell is not tagged 'parameters'")
    return problems


def _normalise(requirement: str) -> str:
    name, _, spec = re.match(r"^([A-Za-z0-9_.\-\[\]]+)\s*(.*)$", requirement.strip()).group(1, 0, 2)
    return re.sub(r"[-_.]+", "-", name).lower() + spec.replace(" ", "")


def pyproject_requirements(pyproject: Path) -> set[str]:
    """Runtime dependencies plus every extra, normalised."""
    project = tomllib.loads(Path(pyproject).read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {_normalise(r) for r in requirements}


def environment_requirements(environment: Path) -> set[str]:
    """The pip section of a conda environment.yml, normalised (the local '-e .' excluded)."""
    env = yaml.safe_load(Path(environment).read_text())
    pip_block = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return {_normalise(r) for r in pip_block if not r.startswith("-e")}


def environment_drift(pyproject: Path, environment: Path) -> dict[str, set[str]]:
    """Requirements only one of the two files lists; empty sets when they agree."""
    ours, conda = pyproject_requirements(pyproject), environment_requirements(environment)
    return {"only_in_pyproject": ours - conda, "only_in_environment": conda - ours}
