"""Reuse a trained model across notebooks — only while everything that produced it is unchanged.

Steps 2 and 3 start from step 1's model, and several chapters need the same SFT or reward
model. Retraining it in every notebook would waste minutes; reusing a stale one would be
worse (DeepSpeed-Chat's data cache keys on file names only and silently serves old data).
:func:`cached` keys a saved artifact on *everything* that determines it: the caller's
settings, the data's content fingerprint, the library's own source code and the versions of
torch, transformers and deepspeed. Change any of them and the artifact is rebuilt.

An artifact is built into a temporary directory and renamed into place only when complete,
so an interrupted run never leaves a half-written model that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

#: Where artifacts live unless DSCHAT_CACHE_DIR says otherwise.
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "dschat-book"
CACHE_ENV = "DSCHAT_CACHE_DIR"
#: Written last into a finished artifact; its key is stored there for inspection.
COMPLETE_MARKER = "artifact.json"


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE_DIR)).expanduser()


def fingerprint(value: Any) -> str:
    """A stable hash of a JSON-serialisable value (dataclasses should be passed as dicts)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def library_fingerprint() -> str:
    """Hash of this library's source and of the versions of the packages that train models."""
    import deepspeed
    import torch
    import transformers

    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    for version in (torch.__version__, transformers.__version__, deepspeed.__version__):
        digest.update(version.encode())
    return digest.hexdigest()


def cached(kind: str, key: dict, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """The directory of the artifact ``kind`` for ``key``, built with ``build(directory)`` if absent.

    ``build`` must write the whole artifact into the directory it is given. Returns the final
    path. ``key`` should name every input that changes the result (settings, data fingerprint,
    seed, the path or fingerprint of a parent artifact).
    """
    root = Path(root) if root is not None else cache_root()
    full_key = {"kind": kind, "key": key, "library": library_fingerprint()}
    final = root / f"{kind}-{fingerprint(full_key)[:16]}"
    if (final / COMPLETE_MARKER).exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".{final.name}.{os.getpid()}.partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        build(staging)
        (staging / COMPLETE_MARKER).write_text(json.dumps(full_key, indent=1, default=str))
        if final.exists():            # an incomplete leftover from an interrupted run
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final
