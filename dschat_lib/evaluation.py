"""Measuring a language model: perplexity, generations, and the ground-truth task score.

Perplexity is ``exp`` of the mean negative log-likelihood per *scored* token — the tokens
whose label is not ``IGNORE_INDEX`` — summed over the whole evaluation set before dividing,
so batches of different lengths weigh by their token counts (averaging per-batch means
would not).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

#: Label value that the loss ignores (PyTorch's cross-entropy default, used by transformers).
IGNORE_INDEX = -100
#: Generation defaults for evaluation: greedy, so "before vs after" compares like with like.
DEFAULT_MAX_NEW_TOKENS = 32


@torch.no_grad()
def perplexity(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]],
               device: torch.device | None = None) -> float:
    """Token-weighted perplexity of ``model`` on batches with input_ids/attention_mask/labels."""
    was_training = model.training
    model.eval()
    device = device or next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
        # Position t predicts token t+1.
        shift_logits = logits[:, :-1].float()
        shift_labels = batch["labels"][:, 1:]
        total_nll += F.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                     shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
                                     reduction="sum").item()
        total_tokens += int((shift_labels != IGNORE_INDEX).sum())
    model.train(was_training)
    if total_tokens == 0:
        raise ValueError("no scored tokens: every label is IGNORE_INDEX")
    return math.exp(total_nll / total_tokens)


@torch.no_grad()
def generate(model: torch.nn.Module, tokenizer, prompts: Sequence[str],
             max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, do_sample: bool = False,
             temperature: float = 1.0, batch_size: int = 64, seed: int | None = None) -> list[str]:
    """Responses to ``prompts`` (prompt text excluded), generated in left-padded batches.

    Left padding keeps every prompt's last token at the same position, which is where
    generation continues; with right padding the model would continue after pad tokens.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    if seed is not None:
        torch.manual_seed(seed)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    responses: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start:start + batch_size])
            encoded = tokenizer(chunk, return_tensors="pt", padding=True).to(device)
            output = model.generate(**encoded, max_new_tokens=max_new_tokens, do_sample=do_sample,
                                    temperature=temperature if do_sample else None,
                                    top_k=0 if do_sample else None, top_p=1.0 if do_sample else None,
                                    pad_token_id=tokenizer.pad_token_id,
                                    eos_token_id=tokenizer.eos_token_id)
            new_tokens = output[:, encoded["input_ids"].shape[1]:]
            responses += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    return responses


def mean_score(scorer: Callable[[str, str], float], prompts: Sequence[str],
               responses: Sequence[str]) -> float:
    """Average of ``scorer(prompt, response)`` over pairs."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return sum(scorer(p, r) for p, r in zip(prompts, responses)) / max(len(prompts), 1)
