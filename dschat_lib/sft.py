"""Step 1: supervised fine-tuning (SFT) of the actor on prompt + chosen response.

The loss is the causal language-modeling loss, the mean negative log-likelihood of each
next token. Which tokens count is the collator's decision (``labels`` = ``IGNORE_INDEX``
where a token is not scored): padding never counts; prompt tokens count unless
``mask_prompt`` is set. DeepSpeed-Chat scores the prompt tokens too, so its step-1 model
also learns to write prompts; masking them spends the whole gradient on the response.

Everything else — ZeRO stage, offload, precision, LoRA, gradient checkpointing, schedule —
is a :class:`dschat_lib.engine.TrainSettings` field, the same as in steps 2 and 3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from dschat_lib import evaluation, training
from dschat_lib.engine import TrainSettings, build_train_engine, log_metrics, optimizer_steps


def lm_loss(engine, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The step-1 loss: transformers' causal-LM loss over the tokens the labels score."""
    output = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=batch["labels"])
    return output.loss, {}


@dataclass
class SFTReport:
    """What a step-1 run measured: before/after perplexity and ground-truth score, the
    training history, and a prompt-by-prompt table of generations."""

    history: list[dict]
    ppl_before: float
    ppl_after: float
    truth_before: float | None = None
    truth_after: float | None = None
    samples: list[dict] = field(default_factory=list)


def evaluate_policy(model, tokenizer, eval_batches: Sequence[dict], prompts: Sequence[str] = (),
                    scorer: Callable[[str, str], float] | None = None,
                    max_new_tokens: int = evaluation.DEFAULT_MAX_NEW_TOKENS) -> dict:
    """Perplexity on ``eval_batches`` and, given prompts and a scorer, the mean ground-truth
    score of greedy responses (with the responses themselves)."""
    result = {"ppl": evaluation.perplexity(model, eval_batches)}
    if prompts:
        responses = evaluation.generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
        result["responses"] = responses
        if scorer is not None:
            result["truth"] = evaluation.mean_score(scorer, prompts, responses)
    return result


def train_sft(model: torch.nn.Module, tokenizer, train_loader, eval_batches: Sequence[dict],
              settings: TrainSettings, num_train_epochs: int = 1, max_micro_steps: int | None = None,
              eval_prompts: Sequence[str] = (), scorer: Callable[[str, str], float] | None = None,
              eval_every: int = 0, max_new_tokens: int = evaluation.DEFAULT_MAX_NEW_TOKENS,
              progress: bool = True, world_size: int | None = None):
    """Run step 1 and measure it. Returns ``(engine, SFTReport)``.

    ``eval_batches`` is a small, fixed list of step-1 batches for perplexity; ``eval_prompts``
    and ``scorer`` add the ground-truth score of greedy generations before and after, and a
    base-vs-fine-tuned table of those generations. ``eval_every`` (optimizer steps) adds eval
    perplexity to the history during training.
    """
    micro_steps = max_micro_steps if max_micro_steps is not None else num_train_epochs * len(train_loader)
    before = evaluate_policy(model, tokenizer, eval_batches, eval_prompts, scorer, max_new_tokens)
    engine = build_train_engine(model, settings,
                                optimizer_steps(micro_steps, settings.gradient_accumulation_steps),
                                world_size=world_size)

    def periodic_eval():
        return {"eval_ppl": evaluation.perplexity(engine.module, eval_batches)}

    history = training.fit(engine, train_loader, lm_loss, num_epochs=num_train_epochs,
                           max_micro_steps=max_micro_steps, evaluate=periodic_eval,
                           eval_every=eval_every, desc="step 1 (SFT)", progress=progress,
                           log=log_metrics)
    after = evaluate_policy(engine.module, tokenizer, eval_batches, eval_prompts, scorer, max_new_tokens)
    samples = [{"prompt": p, "base": b, "fine-tuned": a,
                **({"base score": scorer(p, b), "fine-tuned score": scorer(p, a)} if scorer else {})}
               for p, b, a in zip(eval_prompts, before.get("responses", []), after.get("responses", []))]
    report = SFTReport(history=history, ppl_before=before["ppl"], ppl_after=after["ppl"],
                       truth_before=before.get("truth"), truth_after=after.get("truth"), samples=samples)
    return engine, report
