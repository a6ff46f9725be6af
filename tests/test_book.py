"""The HTML book builds warning-free from the executed notebooks and shows their numbers."""

import re

import pytest

import harness


@pytest.mark.notebook
def test_book_builds_and_quotes_glued_numbers(glue):
    for path in harness.source_notebooks():
        glue(path.stem)                          # executes any stale notebook first
    index = harness.build_book(strict=True)
    assert index.exists()
    intro = (harness.HTML_DIR / "book" / "00-introduction.html").read_text()
    text = re.sub(r"<[^>]+>", "", intro)
    final = glue("00-introduction")["intro_final_loss"]
    assert f"to {final:.2f}" in text            # the glued number reached the prose
    assert "<img" in intro                      # and so did the glued loss plot
