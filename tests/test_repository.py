import repo_checks
from harness import ROOT


def test_environment_yml_matches_pyproject():
    drift = repo_checks.environment_drift(ROOT / "pyproject.toml", ROOT / "environment.yml")
    assert drift == {"only_in_pyproject": set(), "only_in_environment": set()}


def test_ci_runs_make_test():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
