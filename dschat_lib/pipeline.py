"""The whole pipeline: step 1 → step 2 → step 3, each from the previous step's saved checkpoint.

Each step reads what the previous one wrote to disk in Hugging Face format (the SFT model, the
reward model), exactly as DeepSpeed-Chat's three ``main.py`` scripts hand over their outputs.
:func:`main` runs the three steps' own command-line entry points in sequence
(``python -m dschat_lib e2e``); the notebooks use the cached variants
(:func:`sft_checkpoint`, :func:`reward_checkpoint`), which train a model once and reuse it
while nothing that determines it — settings, data, library code, package versions — changed.

Also here: the small pieces the step CLIs share (tokenizer lookup, a distributed loader, and
what a rank does when a step ends).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from dschat_lib import runtime

#: File a step CLI writes next to its model: the run's arguments and its measured summary.
REPORT_FILE = "report.json"


# --------------------------------------------------------------------------- shared CLI pieces

def load_tokenizer_for(model_path: str, tokenizer_path: str | None = None):
    """The tokenizer a step should use: the explicit one, else the one saved beside the model
    (steps save it with their checkpoint), else the shipped tokenizer."""
    from dschat_lib import tokenizer as tokenizer_lib

    if tokenizer_path:
        return tokenizer_lib.load_tokenizer(tokenizer_path)
    if (Path(model_path) / "tokenizer.json").exists() or (Path(model_path) / "tokenizer_config.json").exists():
        return tokenizer_lib.load_tokenizer(model_path)
    return tokenizer_lib.load_tokenizer()


def distributed_loader(dataset, collator, batch_size: int, seed: int, shuffle: bool = True):
    """A DataLoader that gives each rank its own shard (``DistributedSampler``), shuffled with
    ``seed`` so every rank agrees on the permutation; a plain shuffled loader on one rank."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=shuffle, seed=seed)
        return torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                           collate_fn=collator)
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                                       collate_fn=collator, generator=generator)


def finish_rank(output_dir: str, summary: dict, *engines: Any) -> None:
    """End a step: rank 0 writes ``report.json``; every rank reports to a launching parent
    (when :func:`dschat_lib.runtime.launch` started it) and releases its engines."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / REPORT_FILE).write_text(json.dumps(summary, indent=1, default=str))
    if os.environ.get(runtime.RESULT_DIR_ENV):
        runtime.write_rank_result({"rank": rank, **summary})
    runtime.teardown(*engines)
