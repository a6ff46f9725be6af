"""Step 2: train a reward model to rank a better response above a worse one.

**Data.** Rows in the ``Dahoas/rm-static`` schema: a ``prompt`` ending in ``"\\n\\nAssistant:"``,
a ``chosen`` and a ``rejected`` response. Each pair becomes two sequences,
``<s> prompt chosen </s>`` and ``<s> prompt rejected </s>`` (:mod:`dschat_lib.data`, phase 2).
The K-wise variant reads ``k`` responses per prompt, ranked best first.

**Model.** :class:`dschat_lib.models.RewardModel`: a transformer with a scalar head; the reward
of a sequence is the head's output at its last real token (the EOS after the response).
InstructGPT starts its reward model from the SFT model with the LM head removed (Ouyang et
al. 2022, section 3.5); so does this book.

**Loss.** Pairwise (Bradley–Terry): ``-log σ(r_chosen - r_rejected)``, averaged over pairs.
It only sees differences, so the reward's offset is arbitrary — which is why the step-2
report shows the chosen and rejected means *and* their gap. The K-wise loss (InstructGPT,
eq. 1) applies the same term to all ``k(k-1)/2`` ordered pairs of one prompt's ``k``
responses and averages them per prompt: ``k`` forward passes buy ``k(k-1)/2`` comparisons,
and the comparisons from one prompt enter a single gradient step together instead of as
separately shuffled (and correlated) examples.

**Metrics** (logged per step, and in the before/after table a DeepSpeed-Chat step-2 log shows):
``acc`` — share of pairs with ``r_chosen > r_rejected``; ``chosen_mean``/``rejected_mean`` —
mean scores; ``margin`` — mean ``r_chosen - r_rejected``.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from dschat_lib import training
from dschat_lib.engine import TrainSettings, build_train_engine, log_metrics, optimizer_steps

#: The objectives :func:`train_reward_model` knows.
LOSSES = ("pairwise", "k_wise")


# --------------------------------------------------------------------------- losses

def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``mean(-log σ(r_chosen - r_rejected))`` over pairs; ``logsigmoid`` keeps it finite for
    large margins, where ``log(sigmoid(x))`` would underflow to ``log 0``."""
    return -F.logsigmoid(chosen.float() - rejected.float()).mean()


def k_wise_loss(rewards: torch.Tensor) -> torch.Tensor:
    """InstructGPT's ranking loss on ``rewards`` of shape (B, k), each row ranked best first:
    ``-1/C(k,2) Σ_{i<j} log σ(r_i - r_j)`` per prompt, averaged over prompts."""
    k = rewards.shape[1]
    if k < 2:
        raise ValueError(f"a ranking needs at least 2 responses, got k={k}")
    better, worse = zip(*itertools.combinations(range(k), 2))
    margins = rewards.float()[:, list(better)] - rewards.float()[:, list(worse)]
    return -F.logsigmoid(margins).mean(dim=1).mean()


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    chosen, rejected = chosen.float(), rejected.float()
    return {"acc": (chosen > rejected).float().mean().item(), "chosen_mean": chosen.mean().item(),
            "rejected_mean": rejected.mean().item(), "margin": (chosen - rejected).mean().item()}


def pairwise_step(engine, batch: dict) -> tuple[torch.Tensor, dict]:
    """One step-2 loss for :func:`dschat_lib.training.fit`: a batch of B pairs is 2B sequences,
    chosen first (see :class:`dschat_lib.data.PairCollator`), scored in one forward pass."""
    rewards = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["rewards"]
    chosen, rejected = rewards.chunk(2)
    return pairwise_loss(chosen, rejected), pair_metrics(chosen.detach(), rejected.detach())


def k_wise_step(engine, batch: dict) -> tuple[torch.Tensor, dict]:
    """The K-wise loss for :func:`dschat_lib.training.fit` (see :class:`dschat_lib.data.KWiseCollator`).
    Its logged ``acc`` is over the best-vs-worst pair of each group."""
    rewards = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])["rewards"]
    ranked = rewards.view(-1, int(batch["group_size"]))
    return k_wise_loss(ranked), pair_metrics(ranked[:, 0].detach(), ranked[:, -1].detach())


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def sequence_rewards(model, batches: Iterable[dict]) -> torch.Tensor:
    """Rewards of every sequence in ``batches`` (in order), as float32 on the CPU."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    out = []
    for batch in batches:
        rewards = model(input_ids=batch["input_ids"].to(device),
                        attention_mask=batch["attention_mask"].to(device))["rewards"]
        out.append(rewards.float().cpu())
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def evaluate_pairs(model, pair_batches: Iterable[dict]) -> dict:
    """The step-2 evaluation: ``acc``, ``chosen_mean``, ``rejected_mean``, ``margin`` over the
    pairs, plus the per-pair ``chosen`` and ``rejected`` scores (lists, for plotting)."""
    chosen, rejected = [], []
    for batch in pair_batches:
        c, r = sequence_rewards(model, [batch]).chunk(2)
        chosen.append(c)
        rejected.append(r)
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    return {**pair_metrics(chosen, rejected), "chosen": chosen.tolist(), "rejected": rejected.tolist()}


def encode_pairs_of_text(tokenizer, prompts: Sequence[str], responses: Sequence[str]) -> dict:
    """Right-padded ``<s> prompt response </s>`` batch, exactly as step 2 trained on them."""
    from dschat_lib import data

    seqs = [data.encode_prompt(tokenizer, p) + data.encode_response(tokenizer, r)
            for p, r in zip(prompts, responses)]
    length = max(len(s) for s in seqs)
    return {"input_ids": data._pad(seqs, tokenizer.pad_token_id, length),
            "attention_mask": data._mask(seqs, length)}


def score_responses(model, tokenizer, prompts: Sequence[str], responses: Sequence[str],
                    batch_size: int = 64) -> list[float]:
    """The reward model's score of each (prompt, response) — DeepSpeed-Chat's ``rw_eval``."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    batches = [encode_pairs_of_text(tokenizer, prompts[i:i + batch_size], responses[i:i + batch_size])
               for i in range(0, len(prompts), batch_size)]
    return sequence_rewards(model, batches).tolist() if batches else []


def ranking_agreement(model, tokenizer, k_wise_rows: Sequence[dict], batch_size: int = 64) -> dict:
    """How well the reward model's order matches the ground truth on ranked responses.

    ``k_wise_rows`` hold ``responses`` (best first) with their ground-truth ``scores``. Returns
    ``pair_agreement`` — the share of all within-prompt pairs the model orders like the truth —
    and ``spearman``, the rank correlation of model score and true score over every response.
    """
    prompts = [row["prompt"] for row in k_wise_rows for _ in row["responses"]]
    responses = [r for row in k_wise_rows for r in row["responses"]]
    truth = [s for row in k_wise_rows for s in row["scores"]]
    scores = score_responses(model, tokenizer, prompts, responses, batch_size)
    agree = total = 0
    start = 0
    for row in k_wise_rows:
        k = len(row["responses"])
        group = scores[start:start + k]
        for i, j in itertools.combinations(range(k), 2):
            if row["scores"][i] != row["scores"][j]:
                total += 1
                agree += (group[i] - group[j]) * (row["scores"][i] - row["scores"][j]) > 0
        start += k
    return {"pair_agreement": agree / max(total, 1), "spearman": spearman(scores, truth),
            "scores": scores, "truth": truth}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties), without scipy."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for m in range(i, j + 1):
                result[order[m]] = (i + j) / 2
            i = j + 1
        return torch.tensor(result)

    rx, ry = ranks(list(x)), ranks(list(y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.norm() * ry.norm()).item()
    return (rx @ ry).item() / denominator if denominator else 0.0


# --------------------------------------------------------------------------- training

@dataclass
class RewardReport:
    """What a step-2 run measured: the training history and the pair evaluation before/after."""

    history: list[dict]
    before: dict
    after: dict
    loss: str = "pairwise"
    extra: dict = field(default_factory=dict)

    def table(self) -> list[dict]:
        """The before/after rows of a DeepSpeed-Chat step-2 log (without per-pair lists)."""
        keys = ("acc", "chosen_mean", "rejected_mean", "margin")
        return [{"when": when, **{k: result[k] for k in keys}}
                for when, result in (("before", self.before), ("after", self.after))]


def train_reward_model(model, train_loader, eval_batches: Sequence[dict], settings: TrainSettings,
                       loss: str = "pairwise", num_train_epochs: int = 1,
                       max_micro_steps: int | None = None, eval_every: int = 0,
                       progress: bool = True, world_size: int | None = None):
    """Run step 2 and measure it. Returns ``(engine, RewardReport)``.

    ``train_loader`` yields pair batches (``loss="pairwise"``) or K-wise groups
    (``loss="k_wise"``); ``eval_batches`` are pair batches either way, so both variants are
    judged on the same pairs. ``eval_every`` (optimizer steps) adds eval accuracy to the history.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, not {loss!r}")
    step_fn = pairwise_step if loss == "pairwise" else k_wise_step
    micro_steps = max_micro_steps if max_micro_steps is not None else num_train_epochs * len(train_loader)
    before = evaluate_pairs(model, eval_batches)
    engine = build_train_engine(model, settings,
                                optimizer_steps(micro_steps, settings.gradient_accumulation_steps),
                                world_size=world_size)

    def periodic_eval():
        result = evaluate_pairs(engine.module, eval_batches)
        return {"eval_acc": result["acc"], "eval_margin": result["margin"]}

    history = training.fit(engine, train_loader, step_fn, num_epochs=num_train_epochs,
                           max_micro_steps=max_micro_steps, evaluate=periodic_eval,
                           eval_every=eval_every, desc=f"step 2 ({loss})", progress=progress,
                           log=log_metrics)
    after = evaluate_pairs(engine.module, eval_batches)
    return engine, RewardReport(history=history, before=before, after=after, loss=loss)
