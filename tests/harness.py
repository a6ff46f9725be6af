"""Execute the book's notebooks, read what they glued, and build the book from the executed copies.

Used three ways:
- by the tests (``tests/test_notebooks.py`` and each chapter's test) through :func:`executed`,
- by the Makefile: ``python tests/harness.py execute SRC DST`` and ``python tests/harness.py build-book``,
- by a reader who wants the glued numbers of a notebook they ran: :func:`read_glue`.

Execution happens once: papermill writes each executed notebook to ``_build/site/notebooks/``,
and the book is built from that tree with Jupyter Book's own execution switched off. An
executed copy is reused while it is newer than its notebook, the library and the shipped data
(the same rule as the Makefile), so ``make book`` after ``make test`` executes nothing again.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
SITE = ROOT / "_build" / "site"
EXECUTED_DIR = SITE / "notebooks"
HTML_DIR = ROOT / "_build" / "html"

#: Wall-clock budget for one notebook with its default (CPU) parameters, on 2 cores.
DEFAULT_BUDGET_S = float(os.environ.get("DSCHAT_NOTEBOOK_BUDGET_S", 180))
#: Set to 1 to execute notebooks even when an up-to-date executed copy exists.
FORCE_ENV = "DSCHAT_REEXECUTE"
#: What the book build copies next to the executed notebooks.
BOOK_SOURCES = ("_config.yml", "_toc.yml", "book", "references.bib")


def source_notebooks() -> list[Path]:
    return sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def _inputs() -> list[Path]:
    """Files whose change makes every executed notebook stale (mirrors INPUTS in the Makefile)."""
    files = list((ROOT / "dschat_lib").glob("*.py"))
    files += [p for p in (ROOT / "data").rglob("*") if p.is_file()]
    return files


def is_fresh(src: Path, dst: Path) -> bool:
    if not dst.exists() or os.environ.get(FORCE_ENV) == "1":
        return False
    newest_input = max(p.stat().st_mtime for p in [src, *_inputs()])
    return dst.stat().st_mtime > newest_input


def execute(src: Path, dst: Path, parameters: dict | None = None, cell_timeout: float = 900) -> Path:
    """Run ``src`` with papermill into ``dst``; raise on the first failing cell.

    The notebook runs with its own folder as working directory, as it would in JupyterLab.
    Output goes to a temporary file that replaces ``dst`` only on success, so an interrupted
    or failed run never leaves a half-executed notebook that looks fresh.
    """
    import papermill

    src, dst = Path(src).resolve(), Path(dst).resolve()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".partial.ipynb")
    started = time.time()
    try:
        papermill.execute_notebook(str(src), str(tmp), parameters=parameters or {},
                                   kernel_name="python3", cwd=str(src.parent),
                                   execution_timeout=cell_timeout, progress_bar=False)
    except BaseException:
        failed = dst.with_name(dst.name + ".failed.ipynb")
        if tmp.exists():
            os.replace(tmp, failed)
            print(f"the failed run is kept for inspection in {failed}", file=sys.stderr)
        raise
    os.replace(tmp, dst)
    print(f"executed {src.name} in {time.time() - started:.1f} s -> {dst}")
    return dst


#: Notebooks that already failed in this process: asking again re-raises at once instead of
#: spending minutes re-running a notebook known to fail (several tests read each notebook).
_FAILED: dict[str, BaseException] = {}


def executed(name: str) -> Path:
    """The executed copy of ``notebooks/<name>.ipynb``, executing it first if it is stale."""
    src = NOTEBOOK_DIR / (name if name.endswith(".ipynb") else name + ".ipynb")
    if not src.exists():
        raise FileNotFoundError(f"no notebook {src}")
    if src.name in _FAILED:
        raise RuntimeError(f"{src.name} already failed in this run") from _FAILED[src.name]
    dst = EXECUTED_DIR / src.name
    if not is_fresh(src, dst):
        try:
            execute(src, dst)
        except Exception as error:
            _FAILED[src.name] = error
            raise
    return dst


def duration_s(path: Path) -> float:
    """Seconds papermill measured for the whole run of an executed notebook."""
    return float(json.loads(Path(path).read_text())["metadata"]["papermill"]["duration"])


def read_glue(path: Path) -> dict:
    """Every value an executed notebook recorded with ``myst_nb.glue``, by key.

    Numbers and strings come back as Python values (parsed from their ``text/plain`` form);
    figures come back as the dict of their MIME bundle, so a test can check that one exists.
    """
    notebook = json.loads(Path(path).read_text())
    values: dict = {}
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            scrapbook = output.get("metadata", {}).get("scrapbook", {})
            key = scrapbook.get("name")
            if key is None:
                continue
            # Undisplayed values are stored under a prefixed MIME type, e.g.
            # "application/papermill.record/text/plain"; strip it to read them uniformly.
            prefix = scrapbook.get("mime_prefix", "")
            data = {mime[len(prefix):] if mime.startswith(prefix) else mime: value
                    for mime, value in output.get("data", {}).items()}
            if "image/png" in data or "image/svg+xml" in data:
                values[key] = data
                continue
            text = data.get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            try:
                values[key] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                values[key] = text
    return values


def build_book(strict: bool = True) -> Path:
    """Build the HTML book from the executed notebooks; fail on any Sphinx warning."""
    missing = [p.name for p in source_notebooks() if not (EXECUTED_DIR / p.name).exists()]
    if missing:
        raise RuntimeError(f"notebooks not executed yet: {missing}; run `make execute` first")
    SITE.mkdir(parents=True, exist_ok=True)
    for name in BOOK_SOURCES:
        src, dst = ROOT / name, SITE / name
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        if src.is_dir():
            shutil.copytree(src, dst)
        elif src.exists():
            shutil.copy2(src, dst)
    for stray in EXECUTED_DIR.glob("*.ipynb"):
        if not (NOTEBOOK_DIR / stray.name).exists():  # a notebook renamed or removed since
            stray.unlink()
    cmd = [str(Path(sys.executable).parent / "jupyter-book"), "build", str(SITE),
           "--path-output", str(ROOT), "--keep-going"]
    if strict:
        cmd += ["-W", "-n"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
    if proc.returncode != 0:
        raise RuntimeError(f"jupyter-book build failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return HTML_DIR / "index.html"


def _main(argv: list[str]) -> None:
    if argv[:1] == ["execute"] and len(argv) == 3:
        execute(Path(argv[1]), Path(argv[2]))
    elif argv == ["build-book"]:
        print(f"built {build_book()}")
    else:
        sys.exit("usage: harness.py execute SRC.ipynb DST.ipynb | harness.py build-book")


if __name__ == "__main__":
    _main(sys.argv[1:])
