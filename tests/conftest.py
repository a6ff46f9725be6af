import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.fixture(scope="session")
def glue():
    """``glue("03-zero")`` -> the values that notebook recorded, executing it if stale."""
    cache: dict[str, dict] = {}

    def read(name: str) -> dict:
        if name not in cache:
            cache[name] = harness.read_glue(harness.executed(name))
        return cache[name]

    return read
