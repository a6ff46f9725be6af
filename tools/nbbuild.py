"""Write a notebook from a list of ("md"|"code", source) cells: outputs empty, first code
cell tagged ``parameters``. Chapters keep a small generator script beside them in tools/
only while drafting; the committed artefact is the .ipynb."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat


def write_notebook(path: str | Path, cells: list[tuple[str, str]]) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    first_code = True
    for kind, source in cells:
        source = source.strip("\n")
        if kind == "md":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source)
            if first_code:
                cell.metadata["tags"] = ["parameters"]
                first_code = False
            nb.cells.append(cell)
    for cell in nb.cells:
        cell.pop("id", None)
    nb.nbformat_minor = 4
    nbformat.write(nb, str(path))


if __name__ == "__main__":
    sys.exit("import write_notebook from this module")
