"""Record a notebook's results for the book's prose and tests.

The prose never types a number: it quotes what a notebook recorded with ``myst_nb.glue``,
and the tests assert on the same recorded values. :func:`record` is that one call, made
safe for the values notebooks produce (NumPy and torch scalars become plain Python numbers,
so the stored text is ``0.5`` rather than ``np.float64(0.5)``).
"""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """A NumPy/torch scalar as the matching Python number; anything else unchanged."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    return value


def record(key: str, value: Any, display: bool = False) -> Any:
    """Glue ``value`` under ``key`` (a number, string or matplotlib figure) and return it.

    Numbers are shown inline by default in the notebook (``display=False`` keeps the cell
    output clean; the value still appears on the prose page that quotes it).
    """
    from myst_nb import glue

    value = plain(value)
    glue(key, value, display=display)
    return value
