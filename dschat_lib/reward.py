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
from dataclasses import dataclass, field
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


def sampled_agreement(model, policy, tokenizer, prompts: Sequence[str], scorer: Callable[[str, str], float],
                      samples_per_prompt: int = 4, max_new_tokens: int = 16, seed: int = 0) -> dict:
    """Agreement with the ground truth on the *policy's own* responses — what step 3 will feed
    the reward model — rather than on the dataset's pairs.

    Samples ``samples_per_prompt`` responses per prompt from ``policy`` (temperature 1), scores
    them with the reward model and with ``scorer``, and returns ``within_prompt_agreement``: the
    share of same-prompt pairs with different true scores that the reward model orders like the
    truth (0.5 is a coin flip). Only this within-prompt order can guide PPO: a reward that
    differs between *prompts* says nothing about which answer to a prompt is better.
    """
    from dschat_lib import evaluation

    repeated = [p for p in prompts for _ in range(samples_per_prompt)]
    responses = evaluation.generate(policy, tokenizer, repeated, max_new_tokens=max_new_tokens,
                                    do_sample=True, seed=seed)
    truth = [scorer(p, r) for p, r in zip(repeated, responses)]
    scores = score_responses(model, tokenizer, repeated, responses)
    agree = total = 0
    for start in range(0, len(repeated), samples_per_prompt):
        for i, j in itertools.combinations(range(start, start + samples_per_prompt), 2):
            if truth[i] != truth[j]:
                total += 1
                agree += (scores[i] - scores[j]) * (truth[i] - truth[j]) > 0
    return {"within_prompt_agreement": agree / max(total, 1), "pairs": total,
            "spearman": spearman(scores, truth), "mean_truth": sum(truth) / len(truth)}


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


# --------------------------------------------------------------------------- benchmark

def benchmark_step(case: dict, steps: int = 5, warmup: int = 2) -> dict:
    """Time step 2's training step at a benchmark case's shape (``make bench``).

    ``micro_batch_size`` pairs of two ``seq_len``-token sequences (random tokens: speed does
    not depend on what they say) go through a :class:`~dschat_lib.models.RewardModel` built
    from ``arch`` in one forward pass, then the pairwise loss, backward and optimizer step of a
    DeepSpeed engine at ``stage``/``dtype``. A sample is a pair, so tokens/s counts both sides.
    """
    from dschat_lib import benchmark, models

    def build():
        model = models.RewardModel(models.create_hf_model(case["arch"], vocab_size=case["vocab_size"],
                                                          seed=0, head="none"))
        return model, benchmark.model_shape(model)

    def pair_batches():
        # chosen rows first, then rejected: the layout PairCollator produces
        for batch in training.counting_batches(case["vocab_size"], 2 * case["micro_batch_size"], case["seq_len"]):
            yield {"input_ids": batch["input_ids"], "attention_mask": torch.ones_like(batch["input_ids"])}

    row = benchmark.engine_step(case, build, lambda engine, batch: pairwise_step(engine, batch)[0],
                                pair_batches(), steps, warmup, sequences_per_sample=2)
    return {**row, "sample": "a chosen/rejected pair (2 sequences)"}


# --------------------------------------------------------------------------- command line

def build_parser() -> argparse.ArgumentParser:
    """``python -m dschat_lib step2`` options, named like DeepSpeed-Chat's step-2 ``main.py``."""
    from dschat_lib.engine import add_train_arguments

    parser = argparse.ArgumentParser(
        prog="python -m dschat_lib step2",
        description="Step 2: train a reward model on preference pairs (or K-wise rankings) and "
                    "report accuracy and mean chosen/rejected scores before and after.")
    parser.add_argument("--data_path", nargs="*", default=["shipped"],
                        help="datasets: 'shipped' (the book's list task), a supported Hub name "
                             "(e.g. Dahoas/rm-static) or a local json/jsonl/parquet file or directory")
    parser.add_argument("--data_split", default="2,4,4",
                        help="shares of every dataset for steps 1,2,3; step 2 trains on the second")
    parser.add_argument("--model_name_or_path", required=True,
                        help="where the reward model starts: the step-1 output directory (as in "
                             "InstructGPT) or an architecture name such as cpu-tiny (random init)")
    parser.add_argument("--tokenizer_name_or_path", default=None,
                        help="tokenizer directory (default: the model directory if it holds one, "
                             "else the shipped tokenizer)")
    parser.add_argument("--loss", choices=LOSSES, default="pairwise",
                        help="pairwise: -log σ(r_chosen - r_rejected); k_wise: all pairs of k ranked "
                             "responses per prompt (InstructGPT; shipped data only)")
    parser.add_argument("--max_seq_len", type=int, default=64,
                        help="prompt + response tokens; longer pairs are dropped and counted")
    parser.add_argument("--per_device_eval_batch_size", type=int, default=64,
                        help="pairs per evaluation batch")
    parser.add_argument("--num_train_epochs", type=int, default=1, help="passes over the step-2 data")
    parser.add_argument("--max_steps", type=int, default=None,
                        help="stop after this many micro-batches (default: the full epochs)")
    parser.add_argument("--eval_interval", type=int, default=0,
                        help="evaluate every N optimizer steps (0: only before and after)")
    parser.add_argument("--max_eval_pairs", type=int, default=None,
                        help="evaluate on at most this many eval pairs (default: all)")
    parser.add_argument("--output_dir", required=True,
                        help="where the reward model (Hugging Face format) and report.json go")
    parser.add_argument("--disable_progress", action="store_true", help="no progress bar")
    add_train_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run step 2 from the command line (also under ``deepspeed --num_gpus N``)."""
    from dschat_lib import data, models, runtime
    from dschat_lib.engine import settings_from_args
    from dschat_lib.pipeline import distributed_loader, finish_rank, load_tokenizer_for

    args = build_parser().parse_args(argv)
    runtime.init_distributed()
    runtime.seed_everything(args.seed)
    world = torch.distributed.get_world_size()
    tokenizer = load_tokenizer_for(args.model_name_or_path, args.tokenizer_name_or_path)
    pairs = data.build_phase_data(2, tokenizer, args.data_path, data_split=args.data_split,
                                  seed=args.seed, max_seq_len=args.max_seq_len)
    train_data = (data.build_k_wise_data(tokenizer, max_seq_len=args.max_seq_len)
                  if args.loss == "k_wise" else pairs)
    settings = settings_from_args(args, job_name="step2_reward")
    loader = distributed_loader(train_data.train, train_data.collator,
                                settings.per_device_train_batch_size, args.seed)
    eval_items = pairs.eval.items[:args.max_eval_pairs]
    eval_batches = [pairs.collator(eval_items[i:i + args.per_device_eval_batch_size])
                    for i in range(0, len(eval_items), args.per_device_eval_batch_size)]
    model = models.create_reward_model(args.model_name_or_path, tokenizer, seed=args.seed)
    engine, report = train_reward_model(model, loader, eval_batches, settings, loss=args.loss,
                                        num_train_epochs=args.num_train_epochs,
                                        max_micro_steps=args.max_steps, eval_every=args.eval_interval,
                                        progress=not args.disable_progress, world_size=world)
    models.save_hf_model(engine, args.output_dir, tokenizer)
    summary = {"name": "step2", "step": 2, "loss": args.loss, "world_size": world, "table": report.table(),
               "final_train_loss": report.history[-1]["loss"], "data": pairs.stats}
    for row in report.table():
        print(f"step 2 {row['when']:>6}: acc {row['acc']:.3f}  chosen {row['chosen_mean']:+.3f}  "
              f"rejected {row['rejected_mean']:+.3f}  margin {row['margin']:+.3f}")
    finish_rank(args.output_dir, summary, engine)
    return 0


# --------------------------------------------------------------------------- figures

def plot_score_distributions(before: dict, after: dict, bins: int = 30):
    """Histograms of chosen and rejected scores before and after training (one panel each)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, result, title in ((axes[0], before, "before training"), (axes[1], after, "after training")):
        ax.hist(result["chosen"], bins=bins, alpha=0.6, label="chosen")
        ax.hist(result["rejected"], bins=bins, alpha=0.6, label="rejected")
        ax.set_title(f"{title}: acc {result['acc']:.2f}")
        ax.set_xlabel("reward-model score")
    axes[0].set_ylabel("pairs")
    axes[1].legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_training(history: Sequence[dict], window: int = 10):
    """Pairwise loss and training-batch accuracy per step (moving averages)."""
    import matplotlib.pyplot as plt

    from dschat_lib.plots import smooth

    steps = [row["micro_step"] for row in history]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, key, reference in ((axes[0], "loss", 0.6931), (axes[1], "acc", 0.5)):
        values = [row[key] for row in history]
        ax.plot(steps, values, alpha=0.3)
        ax.plot(steps, smooth(values, window), label=f"{window}-step average")
        ax.axhline(reference, color="grey", linestyle="--", label="chance")
        ax.set_xlabel("step")
        ax.set_title(key)
    axes[1].legend()
    fig.tight_layout()
    plt.close(fig)
    return fig


def plot_agreement(scores: Sequence[float], truth: Sequence[float]):
    """Reward-model score against ground-truth score, one dot per response."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.4))
    ax.scatter(truth, scores, s=8, alpha=0.4)
    ax.set_xlabel("ground-truth score")
    ax.set_ylabel("reward-model score")
    ax.set_title(f"Spearman ρ = {spearman(scores, truth):.2f}")
    fig.tight_layout()
    plt.close(fig)
    return fig


if __name__ == "__main__":
    import sys

    sys.exit(main())
