"""Preference data for the three RLHF steps: loading, splitting between steps, tokenizing, caching.

The pipeline, top to bottom:

1. **Load** rows of ``{"prompt", "chosen", "rejected"}`` from the shipped list task, a local
   json/jsonl/parquet file, or a Hub dataset through an adapter (:data:`HUB_ADAPTERS`) that maps
   its fields — the datasets DeepSpeed-Chat supports. Bad rows raise :class:`DataError` naming the
   file and row, or are skipped and counted (``on_invalid="skip"``, the default for Hub data).
2. **Split between steps** with ``data_split`` ("2,4,4"): one seeded permutation per dataset,
   cut into three disjoint shares, so step 2 never trains on the rows step 1 imitated — and every
   step, run in its own process, recomputes the same permutation.
3. **Tokenize** for a phase — step 1: prompt + chosen as one sequence; step 2: chosen/rejected
   pairs (or K-wise groups); step 3: prompts alone — and **collate** into padded batches.
4. **Cache** the tokenized rows under a key made from the rows' *content*, the tokenizer, the
   lengths, the split, the phase and the seed. DeepSpeed-Chat keys its cache on dataset names
   only, so an edited dataset or a new tokenizer silently reuses stale tokens; here either one
   changes the key.

Every sequence is ``<s> prompt response </s>``: BOS added here, explicitly (not by the tokenizer's
post-processor), EOS after the response and never after a prompt, so generation in step 3 starts
exactly where training responses started.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dschat_lib import tasks

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
#: The shipped task files, by split name.
SHIPPED_FILES = {"train": "list_task_train.jsonl", "eval": "list_task_eval.jsonl",
                 "k_wise_train": "list_task_k_wise_train.jsonl",
                 "k_wise_eval": "list_task_k_wise_eval.jsonl"}
#: The name that means "the shipped list task" wherever a dataset name is expected.
SHIPPED = "shipped"
REQUIRED_FIELDS = ("prompt", "chosen", "rejected")
#: Step numbers, as in DeepSpeed-Chat: 1 SFT, 2 reward model, 3 PPO.
PHASES = (1, 2, 3)
#: Label value the loss ignores (PyTorch's cross-entropy default).
IGNORE_INDEX = -100
#: Share of a train-only Hub dataset held out as its eval split.
EVAL_HOLDOUT_FRACTION = 0.05
DEFAULT_SEED = 1234
#: Where tokenized data are cached unless a call says otherwise.
DEFAULT_CACHE_DIR = Path(os.environ.get("DSCHAT_DATA_CACHE", "~/.cache/dschat-book/tokenized")).expanduser()
#: Bump when the tokenized format changes, so old cache files are never read as new ones.
CACHE_FORMAT_VERSION = 1


class DataError(ValueError):
    """Bad data or a bad data argument; the message names the file, row or argument."""


# =========================================================================== loading

@dataclass
class PreferenceData:
    """Rows of one dataset (or several combined), with what was skipped and why."""
    name: str
    train: list[dict]
    eval: list[dict]
    skipped: Counter = field(default_factory=Counter)


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a local ``.json``/``.jsonl``/``.parquet`` file, through ``datasets``."""
    import datasets

    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r} (use .json, .jsonl or .parquet)")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as error:  # datasets wraps parse errors in several exception types
        raise DataError(f"{path}: could not be read as {kind}: {error}") from error
    return loaded.to_list()


def check_rows(rows: Sequence[dict], source: str, on_invalid: str = "raise",
               fields: Sequence[str] = REQUIRED_FIELDS) -> tuple[list[dict], Counter]:
    """Rows with every field in ``fields`` present, a non-empty string, and chosen != rejected.

    ``on_invalid="raise"``: the first bad row raises :class:`DataError` naming ``source`` and the
    row (numbered from 1, the line number of a .jsonl file). ``"skip"``: bad rows are left out
    and counted by reason in the returned Counter.
    """
    if on_invalid not in ("raise", "skip"):
        raise DataError(f"on_invalid must be 'raise' or 'skip', not {on_invalid!r}")
    if not rows:
        raise DataError(f"{source}: no rows")
    good, skipped = [], Counter()
    for number, row in enumerate(rows, start=1):
        problem = _row_problem(row, fields)
        if problem is None:
            good.append({k: row[k] for k in fields})
        elif on_invalid == "skip":
            skipped[problem.split(":")[0]] += 1
        else:
            raise DataError(f"{source}, row {number}: {problem}")
    if not good:
        raise DataError(f"{source}: all {len(rows)} rows are invalid ({dict(skipped)})")
    return good, skipped


def _row_problem(row: Any, fields: Sequence[str]) -> str | None:
    if not isinstance(row, dict):
        return f"not an object: {row!r:.60}"
    for name in fields:
        if name not in row or row[name] is None:
            return f"missing field: {name!r}"
        if not isinstance(row[name], str):
            return f"field not a string: {name!r} is {type(row[name]).__name__}"
        if not row[name].strip():
            return f"empty field: {name!r}"
    if "rejected" in fields and row["chosen"] == row["rejected"]:
        return "chosen identical to rejected: a pair with no preference"
    return None


# --------------------------------------------------------------------------- the shipped task

def shipped_path(split: str = "train", data_dir: str | Path = DATA_DIR) -> Path:
    if split not in SHIPPED_FILES:
        raise DataError(f"unknown shipped split {split!r}; known: {sorted(SHIPPED_FILES)}")
    return Path(data_dir) / SHIPPED_FILES[split]


def load_shipped(split: str = "train", data_dir: str | Path = DATA_DIR) -> list[dict]:
    """A shipped split as a list of dicts: ``train``/``eval`` (Dahoas/rm-static schema) or
    ``k_wise_train``/``k_wise_eval`` (``prompt``, ``responses`` best first, ``scores``)."""
    path = shipped_path(split, data_dir)
    if not path.exists():
        raise DataError(f"{path} is missing; regenerate it with `python -m dschat_lib.data regenerate`")
    with path.open(encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    if split.startswith("k_wise"):
        for number, row in enumerate(rows, start=1):
            check_k_wise_row(row, f"{path}, row {number}")
        return rows
    check_rows(rows, str(path))  # raises on the first bad row
    return rows


def check_k_wise_row(row: dict, where: str) -> None:
    responses = row.get("responses")
    if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
        raise DataError(f"{where}: missing or empty 'prompt'")
    if not isinstance(responses, list) or len(responses) < 2:
        raise DataError(f"{where}: 'responses' must be a list of at least 2 ranked responses")
    if any(not isinstance(r, str) or not r.strip() for r in responses):
        raise DataError(f"{where}: a response is missing or empty")
    if len(set(responses)) != len(responses):
        raise DataError(f"{where}: two responses are identical, so their ranking means nothing")


def write_jsonl(rows: Iterable[dict], path: str | Path) -> None:
    """One JSON object per line, keys in insertion order — a byte-stable format for regeneration."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8", newline="\n") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def regenerate(out_dir: str | Path = DATA_DIR, seed: int = tasks.DEFAULT_SEED) -> list[Path]:
    """Write every shipped file (task splits and tokenizer) into ``out_dir``, from ``seed``."""
    from dschat_lib import tokenizer as tokenizer_lib

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = tasks.generate_splits(seed)
    written = []
    for split, rows in splits.items():
        path = shipped_path(split, out_dir)
        write_jsonl(rows, path)
        written.append(path)
    tok = tokenizer_lib.train_tokenizer(tokenizer_lib.training_corpus(splits["train"]))
    tok.save_pretrained(str(out_dir / "tokenizer"))
    written += sorted((out_dir / "tokenizer").iterdir())
    return written


# --------------------------------------------------------------------------- Hub adapters
# Each maps one public dataset's fields to prompt/chosen/rejected in the "\n\nHuman: ...
# \n\nAssistant:" form. A converter returns the row, or a string saying why the row is skipped.

HUMAN, ASSISTANT = tasks.HUMAN, tasks.ASSISTANT


def _dialogue(question: str) -> str:
    return f"{HUMAN}{question.strip()}{ASSISTANT}"


def _answer(text: str) -> str:
    return " " + text.strip()


def _from_hh_schema(row: dict) -> dict | str:
    # Already prompt/chosen/rejected with the Human/Assistant markers.
    return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}


def _from_question_pairs(row: dict) -> dict | str:
    # A bare question and two bare answers.
    return {"prompt": _dialogue(row["prompt"]), "chosen": _answer(row["chosen"]),
            "rejected": _answer(row["rejected"])}


def _from_split_assistant(row: dict) -> dict | str:
    # The prompt stops before "Assistant:"; the answers start with it.
    def after_marker(text: str) -> str:
        return " " + text.rsplit("Assistant:", 1)[-1].strip()
    return {"prompt": row["prompt"].rstrip(" ") + "Assistant:", "chosen": after_marker(row["chosen"]),
            "rejected": after_marker(row["rejected"])}


_CITATION = re.compile(r"\s?\[\d+(?:,\s?\d+)*\]")


def _from_webgpt(row: dict) -> dict | str:
    # Two answers with human scores; equal scores state no preference. The answers cite their
    # sources as "[1]", which a model without the sources cannot use, so the markers are removed.
    if row["score_0"] == row["score_1"]:
        return "tie: equal human scores"
    better, worse = ("answer_0", "answer_1") if row["score_0"] > row["score_1"] else ("answer_1", "answer_0")
    return {"prompt": _dialogue(row["question"]["full_text"]),
            "chosen": _answer(_CITATION.sub("", row[better])),
            "rejected": _answer(_CITATION.sub("", row[worse]))}


def _from_shp(row: dict) -> dict | str:
    # labels == 1 means the first reference answer (A) was preferred.
    chosen, rejected = ("human_ref_A", "human_ref_B") if row["labels"] == 1 else ("human_ref_B", "human_ref_A")
    return {"prompt": _dialogue(row["history"]), "chosen": _answer(row[chosen]),
            "rejected": _answer(row[rejected])}


@dataclass(frozen=True)
class HubAdapter:
    name: str                        # the Hub id
    convert: Callable[[dict], dict | str]
    fields: tuple[str, ...]          # fields a source row must have
    train_split: str = "train"
    eval_split: str | None = "test"  # None: hold out EVAL_HOLDOUT_FRACTION of train


HUB_ADAPTERS: dict[str, HubAdapter] = {a.name: a for a in (
    HubAdapter("Dahoas/rm-static", _from_hh_schema, ("prompt", "chosen", "rejected")),
    HubAdapter("Dahoas/full-hh-rlhf", _from_hh_schema, ("prompt", "chosen", "rejected")),
    HubAdapter("Dahoas/synthetic-instruct-gptj-pairwise", _from_question_pairs,
               ("prompt", "chosen", "rejected"), eval_split=None),
    HubAdapter("yitingxie/rlhf-reward-datasets", _from_split_assistant, ("prompt", "chosen", "rejected")),
    HubAdapter("openai/webgpt_comparisons", _from_webgpt,
               ("question", "answer_0", "answer_1", "score_0", "score_1"), eval_split=None),
    HubAdapter("stanfordnlp/SHP", _from_shp, ("history", "human_ref_A", "human_ref_B", "labels"),
               eval_split="validation"),
)}


def _local_split_file(directory: Path, split: str) -> Path | None:
    for suffix in (".jsonl", ".json", ".parquet"):
        if (directory / f"{split}{suffix}").exists():
            return directory / f"{split}{suffix}"
    return None


def _hub_split_rows(adapter: HubAdapter, split: str, local_dir: Path | None) -> tuple[list[dict], str]:
    """Raw rows of one split, from ``local_dir/<split>.jsonl`` (a mirror or test fixture) or the Hub."""
    if local_dir is not None:
        path = _local_split_file(local_dir, split)
        if path is None:
            raise DataError(f"{local_dir}: no {split}.jsonl/.json/.parquet for {adapter.name}")
        return read_rows(path), str(path)
    import datasets
    datasets.disable_progress_bars()
    return datasets.load_dataset(adapter.name, split=split).to_list(), f"{adapter.name}[{split}]"


def _convert_rows(adapter: HubAdapter, rows: list[dict], source: str) -> tuple[list[dict], Counter]:
    converted, skipped = [], Counter()
    for number, row in enumerate(rows, start=1):
        missing = [f for f in adapter.fields if row.get(f) is None]  # datasets fills gaps with None
        if missing:
            raise DataError(f"{source}, row {number}: missing field(s) {missing} of the "
                            f"{adapter.name} schema")
        result = adapter.convert(row)
        if isinstance(result, str):
            skipped[result.split(":")[0]] += 1
        else:
            converted.append(result)
    return converted, skipped


def _holdout(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(rows) * fraction)) if len(rows) > 1 else 0
    eval_ids = set(order[:n_eval])
    return ([r for i, r in enumerate(rows) if i not in eval_ids],
            [r for i, r in enumerate(rows) if i in eval_ids])


def load_preference_data(source: str | Path, *, local_dir: str | Path | None = None,
                         on_invalid: str | None = None, seed: int = DEFAULT_SEED) -> PreferenceData:
    """Train and eval rows of one source, as prompt/chosen/rejected dicts.

    ``source`` is ``"shipped"`` (the book's list task), a Hub dataset name from
    :data:`HUB_ADAPTERS`, or a local path: a file (its rows are split into train/eval with
    ``EVAL_HOLDOUT_FRACTION``) or a directory with ``train.*`` and ``eval.*``/``test.*`` files.
    ``local_dir`` reads a Hub dataset's splits from ``<local_dir>/<split>.jsonl`` (an offline
    mirror, or the tests' fixtures) instead of downloading. ``on_invalid``: "raise" or "skip";
    by default local data raise (fix your file) and Hub data skip and count (not yours to fix).
    """
    name = str(source)
    if name == SHIPPED:
        train, eval_ = load_shipped("train"), load_shipped("eval")
        return PreferenceData(SHIPPED, [_pair(r) for r in train], [_pair(r) for r in eval_])
    if name in HUB_ADAPTERS:
        adapter = HUB_ADAPTERS[name]
        mode = on_invalid or "skip"
        skipped: Counter = Counter()
        splits = {}
        wanted = [adapter.train_split] + ([adapter.eval_split] if adapter.eval_split else [])
        for split in wanted:
            raw, where = _hub_split_rows(adapter, split, Path(local_dir) if local_dir else None)
            converted, conversion_skips = _convert_rows(adapter, raw, where)
            skipped.update(conversion_skips)
            splits[split], check_skips = check_rows(converted, where, mode) if converted else ([], Counter())
            skipped.update(check_skips)
            if not splits[split]:
                raise DataError(f"{where}: no usable rows ({dict(skipped)})")
        if adapter.eval_split:
            train, eval_ = splits[adapter.train_split], splits[adapter.eval_split]
        else:
            train, eval_ = _holdout(splits[adapter.train_split], EVAL_HOLDOUT_FRACTION, seed)
        return PreferenceData(name, train, eval_, skipped)
    path = Path(source)
    if path.is_dir():
        train_file = _local_split_file(path, "train")
        eval_file = _local_split_file(path, "eval") or _local_split_file(path, "test")
        if train_file is None or eval_file is None:
            raise DataError(f"{path}: a data directory needs train.* and eval.* (or test.*) files")
        mode = on_invalid or "raise"
        train, s1 = check_rows(read_rows(train_file), str(train_file), mode)
        eval_, s2 = check_rows(read_rows(eval_file), str(eval_file), mode)
        return PreferenceData(str(path), train, eval_, s1 + s2)
    if path.is_file():
        rows, skipped = check_rows(read_rows(path), str(path), on_invalid or "raise")
        train, eval_ = _holdout(rows, EVAL_HOLDOUT_FRACTION, seed)
        return PreferenceData(str(path), train, eval_, skipped)
    raise DataError(f"unknown dataset {name!r}: not 'shipped', not a local file or directory, "
                    f"and not one of the supported Hub datasets {sorted(HUB_ADAPTERS)}")


def _pair(row: dict) -> dict:
    return {"prompt": row["prompt"], "chosen": row["chosen"], "rejected": row["rejected"]}


def load_sft_only(source: str | Path, on_invalid: str | None = None) -> list[dict]:
    """Rows for step 1 only (``sft_only_data_path``): a local file of ``prompt`` + ``chosen``
    (``rejected`` not needed). All of them go to step 1; none are held out."""
    path = Path(source)
    if not path.is_file():
        raise DataError(f"sft_only_data_path {source!r}: no such file")
    rows, _ = check_rows(read_rows(path), str(path), on_invalid or "raise", fields=("prompt", "chosen"))
    return rows


# =========================================================================== data_split

def parse_data_split(data_split: str) -> tuple[float, float, float]:
    """``"2,4,4"`` -> (0.2, 0.4, 0.4): the shares of every dataset for steps 1, 2 and 3."""
    parts = str(data_split).split(",")
    if len(parts) != 3:
        raise DataError(f"data_split={data_split!r}: needs three comma-separated weights, one per "
                        "step (e.g. '2,4,4')")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"data_split={data_split!r}: weights must be numbers") from None
    if any(w < 0 or w != w or w == float("inf") for w in weights):
        raise DataError(f"data_split={data_split!r}: weights must be finite and non-negative")
    total = sum(weights)
    if total == 0:
        raise DataError(f"data_split={data_split!r}: all weights are zero, no step gets data")
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def phase_indices(num_rows: int, data_split: str, phase: int, seed: int = DEFAULT_SEED) -> list[int]:
    """The row indices ``phase`` (1, 2 or 3) gets from a dataset of ``num_rows`` rows.

    One permutation from ``seed`` is cut at the cumulative shares, so the three phases' indices
    are disjoint and together cover every row, whichever phase asks first.
    """
    if phase not in PHASES:
        raise DataError(f"phase must be one of {PHASES}, not {phase!r}")
    shares = parse_data_split(data_split)
    order = list(range(num_rows))
    random.Random(seed).shuffle(order)
    bounds, cumulative = [0], 0.0
    for share in shares:
        cumulative += share
        bounds.append(round(cumulative * num_rows))
    return sorted(order[bounds[phase - 1]:bounds[phase]])


def phase_rows(sources: Sequence[str | Path], data_split: str, phase: int, seed: int = DEFAULT_SEED,
               sft_only: Sequence[str | Path] = (), local_dirs: dict[str, str | Path] | None = None,
               on_invalid: str | None = None) -> PreferenceData:
    """The rows ``phase`` trains and evaluates on: its share of every source, combined and
    shuffled with ``seed``. ``sft_only`` files are added, whole, to phase 1."""
    if isinstance(sources, (str, Path)):
        sources = [sources]
    if not sources:
        raise DataError("no data sources given")
    local_dirs = local_dirs or {}
    combined = PreferenceData("+".join(str(s) for s in sources), [], [])
    for source in sources:
        data = load_preference_data(source, local_dir=local_dirs.get(str(source)),
                                    on_invalid=on_invalid, seed=seed)
        combined.train += [data.train[i] for i in phase_indices(len(data.train), data_split, phase, seed)]
        combined.eval += [data.eval[i] for i in phase_indices(len(data.eval), data_split, phase, seed)]
        combined.skipped.update(data.skipped)
    if phase == 1:
        for path in sft_only:
            combined.train += load_sft_only(path, on_invalid)
    if not combined.train:
        raise DataError(f"data_split={data_split!r} leaves step {phase} no training rows")
    rng = random.Random(seed)
    rng.shuffle(combined.train)
    rng.shuffle(combined.eval)
    return combined


# =========================================================================== tokenizing

def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """``<s>`` + the prompt's tokens. No EOS: the response continues from here."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def encode_response(tokenizer, response: str) -> list[int]:
    """The response's tokens + ``</s>``, which teaches the model where to stop."""
    return tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def tokenize_phase(rows: Sequence[dict], tokenizer, phase: int, *, max_seq_len: int,
                   max_prompt_len: int | None = None, mask_prompt: bool = True) -> tuple[list[dict], Counter]:
    """Tokenized items of a phase, and the count of rows dropped for being too long.

    Phase 1: ``input_ids`` = prompt + chosen, ``labels`` the same with the prompt's positions set
    to -100 when ``mask_prompt`` (the loss then scores only the response; ``False`` scores the
    whole sequence, as DeepSpeed-Chat does). Phase 2: ``chosen_ids``, ``rejected_ids`` and the
    ``prompt_len`` they share. Phase 3: ``prompt_ids`` and ``prompt`` text (for scoring).
    Rows longer than the limit are dropped and counted — cutting them would teach a model
    truncated answers (phases 1–2) or hide the question (phase 3).
    """
    items, dropped = [], Counter()
    for row in rows:
        prompt_ids = encode_prompt(tokenizer, row["prompt"])
        if phase == 1:
            response_ids = encode_response(tokenizer, row["chosen"])
            input_ids = prompt_ids + response_ids
            if len(input_ids) > max_seq_len:
                dropped["longer than max_seq_len"] += 1
                continue
            labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids) if mask_prompt else list(input_ids)
            items.append({"input_ids": input_ids, "labels": labels})
        elif phase == 2:
            chosen = prompt_ids + encode_response(tokenizer, row["chosen"])
            rejected = prompt_ids + encode_response(tokenizer, row["rejected"])
            if max(len(chosen), len(rejected)) > max_seq_len:
                dropped["longer than max_seq_len"] += 1
                continue
            items.append({"chosen_ids": chosen, "rejected_ids": rejected, "prompt_len": len(prompt_ids)})
        elif phase == 3:
            limit = max_prompt_len if max_prompt_len is not None else max_seq_len
            if len(prompt_ids) > limit:
                dropped["longer than max_prompt_len"] += 1
                continue
            items.append({"prompt_ids": prompt_ids, "prompt": row["prompt"]})
        else:
            raise DataError(f"phase must be one of {PHASES}, not {phase!r}")
    return items, dropped


def tokenize_k_wise(rows: Sequence[dict], tokenizer, *, max_seq_len: int) -> tuple[list[dict], Counter]:
    """K-wise groups: ``sequences`` (k token lists, best first) and their ``prompt_len``."""
    items, dropped = [], Counter()
    for row in rows:
        prompt_ids = encode_prompt(tokenizer, row["prompt"])
        sequences = [prompt_ids + encode_response(tokenizer, r) for r in row["responses"]]
        if max(len(s) for s in sequences) > max_seq_len:
            dropped["longer than max_seq_len"] += 1
            continue
        items.append({"sequences": sequences, "prompt_len": len(prompt_ids)})
    return items, dropped


# =========================================================================== collators
# Training batches are padded on the right (positions stay 0..n for every sequence); prompt
# batches for generation are padded on the left (every prompt ends where generation begins).

def _pad(sequences: Sequence[Sequence[int]], value: int, length: int, left: bool = False) -> torch.Tensor:
    out = torch.full((len(sequences), length), value, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise DataError(f"a sequence of {len(seq)} tokens does not fit the padded length {length}")
        if left:
            out[i, length - len(seq):] = torch.tensor(seq, dtype=torch.long)
        else:
            out[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def _mask(sequences: Sequence[Sequence[int]], length: int, left: bool = False) -> torch.Tensor:
    return _pad([[1] * len(s) for s in sequences], 0, length, left)


@dataclass
class SFTCollator:
    """Phase 1 batches: ``input_ids``, ``attention_mask``, ``labels`` (pad positions -100).
    Pads to the longest sequence in the batch, or to ``pad_to`` (fixed shapes, for benchmarks)."""
    pad_token_id: int
    pad_to: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [item["input_ids"] for item in items]
        length = self.pad_to or max(len(s) for s in seqs)
        return {"input_ids": _pad(seqs, self.pad_token_id, length),
                "attention_mask": _mask(seqs, length),
                "labels": _pad([item["labels"] for item in items], IGNORE_INDEX, length)}


@dataclass
class PairCollator:
    """Phase 2 batches of B pairs: ``input_ids``/``attention_mask`` of shape (2B, L), the B chosen
    sequences first, then the B rejected ones in the same order — one forward pass scores both
    halves, and ``rewards[:B] - rewards[B:]`` is each pair's margin. ``prompt_len`` (B,)."""
    pad_token_id: int
    pad_to: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, torch.Tensor]:
        seqs = [item["chosen_ids"] for item in items] + [item["rejected_ids"] for item in items]
        length = self.pad_to or max(len(s) for s in seqs)
        return {"input_ids": _pad(seqs, self.pad_token_id, length),
                "attention_mask": _mask(seqs, length),
                "prompt_len": torch.tensor([item["prompt_len"] for item in items])}


@dataclass
class KWiseCollator:
    """K-wise batches of B groups: (B*k, L) with each group's k sequences consecutive, best first;
    ``group_size`` = k, so ``rewards.view(B, k)`` puts one prompt's ranking on each row."""
    pad_token_id: int
    pad_to: int | None = None

    def __call__(self, items: Sequence[dict]) -> dict[str, Any]:
        sizes = {len(item["sequences"]) for item in items}
        if len(sizes) != 1:
            raise DataError(f"K-wise groups in one batch must have the same k, got sizes {sorted(sizes)}")
        seqs = [seq for item in items for seq in item["sequences"]]
        length = self.pad_to or max(len(s) for s in seqs)
        return {"input_ids": _pad(seqs, self.pad_token_id, length),
                "attention_mask": _mask(seqs, length), "group_size": sizes.pop(),
                "prompt_len": torch.tensor([item["prompt_len"] for item in items])}


@dataclass
class PromptCollator:
    """Phase 3 batches: prompts left-padded to exactly ``max_prompt_len`` (``input_ids``,
    ``attention_mask``) and the prompt texts (``prompt``) for scoring the generated answers."""
    pad_token_id: int
    max_prompt_len: int

    def __call__(self, items: Sequence[dict]) -> dict[str, Any]:
        seqs = [item["prompt_ids"] for item in items]
        return {"input_ids": _pad(seqs, self.pad_token_id, self.max_prompt_len, left=True),
                "attention_mask": _mask(seqs, self.max_prompt_len, left=True),
                "prompt": [item["prompt"] for item in items]}


# =========================================================================== the cache

def fingerprint(value: Any) -> str:
    """SHA-256 of a JSON-serialisable value (canonical: sorted keys, no spaces)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Changes whenever the tokenizer would produce different ids: vocabulary, merges, normaliser,
    special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    description = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return fingerprint({"tokenizer": description, "special": tokenizer.special_tokens_map,
                        "ids": [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]})


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def cached(key: dict, build: Callable[[], Any], cache_dir: str | Path | None = DEFAULT_CACHE_DIR
           ) -> tuple[Any, bool]:
    """``build()``'s JSON-serialisable result, cached on disk under the fingerprint of ``key``.

    Returns ``(value, hit)``. The file is written to a temporary name and renamed, so a crash
    never leaves half a cache file. With several ranks, rank 0 builds and writes while the
    others wait at a barrier and then read — N ranks never tokenize the same data N times or
    race on one file. ``cache_dir=None`` turns caching off.
    """
    if cache_dir is None:
        return build(), False
    path = Path(cache_dir) / f"{fingerprint({**key, 'format': CACHE_FORMAT_VERSION})}.json"
    rank, world = _rank_and_world()
    hit = path.exists()
    if not hit and rank == 0:
        value = build()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value))
        os.replace(tmp, path)
    if world > 1:
        torch.distributed.barrier()
    if rank == 0 and not hit:
        return value, False
    return json.loads(path.read_text()), hit


# =========================================================================== phase datasets

class ListDataset(torch.utils.data.Dataset):
    """A list of tokenized items, indexable by a DataLoader."""

    def __init__(self, items: list[dict]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


@dataclass
class PhaseData:
    """What a training step needs: tokenized train/eval datasets, the raw rows, and a report."""
    phase: int
    train: ListDataset
    eval: ListDataset
    train_rows: list[dict]
    eval_rows: list[dict]
    collator: Callable
    stats: dict


def build_phase_data(phase: int, tokenizer, sources: Sequence[str | Path] = (SHIPPED,), *,
                     data_split: str = "2,4,4", seed: int = DEFAULT_SEED, max_seq_len: int = 64,
                     max_prompt_len: int = 32, mask_prompt: bool = True,
                     sft_only: Sequence[str | Path] = (), local_dirs: dict[str, str | Path] | None = None,
                     on_invalid: str | None = None,
                     cache_dir: str | Path | None = DEFAULT_CACHE_DIR) -> PhaseData:
    """Datasets and collator for step ``phase`` (1 SFT, 2 reward model, 3 PPO prompts).

    Rows come from :func:`phase_rows`; tokenization from :func:`tokenize_phase`, cached under a
    key of the rows' content, the tokenizer's fingerprint, the lengths, the split, the phase,
    the seed and ``mask_prompt``. ``stats`` reports row counts, drops and skips, and whether the
    cache was hit.
    """
    rows = phase_rows(sources, data_split, phase, seed, sft_only=sft_only, local_dirs=local_dirs,
                      on_invalid=on_invalid)
    settings = {"phase": phase, "max_seq_len": max_seq_len, "max_prompt_len": max_prompt_len,
                "mask_prompt": mask_prompt, "data_split": data_split, "seed": seed}
    key = {"rows": fingerprint([rows.train, rows.eval]), "tokenizer": tokenizer_fingerprint(tokenizer),
           **settings}

    def build() -> dict:
        out = {}
        for split, split_rows in (("train", rows.train), ("eval", rows.eval)):
            items, dropped = tokenize_phase(split_rows, tokenizer, phase, max_seq_len=max_seq_len,
                                            max_prompt_len=max_prompt_len, mask_prompt=mask_prompt)
            out[split] = {"items": items, "dropped": dict(dropped)}
        return out

    tokenized, hit = cached(key, build, cache_dir)
    if not tokenized["train"]["items"]:
        raise DataError(f"step {phase}: every training row was dropped as too long "
                        f"({tokenized['train']['dropped']}); raise max_seq_len/max_prompt_len")
    pad = tokenizer.pad_token_id
    collator = {1: SFTCollator(pad), 2: PairCollator(pad), 3: PromptCollator(pad, max_prompt_len)}[phase]
    stats = {"sources": [str(s) for s in sources], **settings, "cache_hit": hit,
             "train_rows": len(rows.train), "eval_rows": len(rows.eval),
             "train_items": len(tokenized["train"]["items"]), "eval_items": len(tokenized["eval"]["items"]),
             "dropped_train": tokenized["train"]["dropped"], "dropped_eval": tokenized["eval"]["dropped"],
             "skipped_rows": dict(rows.skipped)}
    return PhaseData(phase, ListDataset(tokenized["train"]["items"]), ListDataset(tokenized["eval"]["items"]),
                     rows.train, rows.eval, collator, stats)


def build_k_wise_data(tokenizer, *, max_seq_len: int = 64, data_dir: str | Path = DATA_DIR,
                      cache_dir: str | Path | None = DEFAULT_CACHE_DIR) -> PhaseData:
    """The shipped K-wise splits, tokenized (cached like :func:`build_phase_data`), with
    :class:`KWiseCollator`. Used by the K-wise reward model variant of step 2."""
    train_rows, eval_rows = load_shipped("k_wise_train", data_dir), load_shipped("k_wise_eval", data_dir)
    key = {"rows": fingerprint([train_rows, eval_rows]), "tokenizer": tokenizer_fingerprint(tokenizer),
           "phase": "2-k-wise", "max_seq_len": max_seq_len}

    def build() -> dict:
        out = {}
        for split, rows in (("train", train_rows), ("eval", eval_rows)):
            items, dropped = tokenize_k_wise(rows, tokenizer, max_seq_len=max_seq_len)
            out[split] = {"items": items, "dropped": dict(dropped)}
        return out

    tokenized, hit = cached(key, build, cache_dir)
    stats = {"cache_hit": hit, "train_rows": len(train_rows), "eval_rows": len(eval_rows),
             "train_items": len(tokenized["train"]["items"]), "eval_items": len(tokenized["eval"]["items"]),
             "dropped_train": tokenized["train"]["dropped"], "dropped_eval": tokenized["eval"]["dropped"]}
    return PhaseData(2, ListDataset(tokenized["train"]["items"]), ListDataset(tokenized["eval"]["items"]),
                     train_rows, eval_rows, KWiseCollator(tokenizer.pad_token_id), stats)


def dataloader(data: PhaseData, batch_size: int, split: str = "train", shuffle: bool | None = None,
               seed: int = DEFAULT_SEED) -> torch.utils.data.DataLoader:
    """A DataLoader over ``data.train`` or ``data.eval`` with the phase's collator; training data
    are shuffled with a seeded generator (so a run repeats), eval data are not."""
    dataset = data.train if split == "train" else data.eval
    shuffle = (split == "train") if shuffle is None else shuffle
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=shuffle,
                                       collate_fn=data.collator, generator=generator)


# =========================================================================== command line

def _main(argv: list[str]) -> None:
    if argv[:1] == ["regenerate"]:
        out = Path(argv[1]) if len(argv) > 1 else DATA_DIR
        for path in regenerate(out):
            print(path)
    else:
        sys.exit("usage: python -m dschat_lib.data regenerate [OUT_DIR]")


if __name__ == "__main__":
    _main(sys.argv[1:])
