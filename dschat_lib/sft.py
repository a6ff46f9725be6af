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


# =========================================================================== command line

#: Prompts whose greedy answers are scored against the ground truth after training (shipped
#: task only: other datasets have no ground truth).
DEFAULT_NUM_EVAL_PROMPTS = 64
#: Eval sequences used for perplexity, in batches of the eval batch size.
DEFAULT_NUM_EVAL_SEQUENCES = 256


def build_parser():
    """``python -m dschat_lib step1``: flags named like DeepSpeed-Chat's step-1 ``main.py``."""
    import argparse

    from dschat_lib import data, engine

    parser = argparse.ArgumentParser(
        prog="python -m dschat_lib step1",
        description="Step 1: supervised fine-tuning of the actor on prompt + chosen response. "
                    "Runs on one process or under `deepspeed --num_gpus N` / torchrun; writes a "
                    "Hugging Face model (safetensors), its tokenizer and report.json to --output_dir.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--data_path", nargs="*", default=[data.SHIPPED],
        help="datasets: 'shipped' (the book's list task), a Hub name such as Dahoas/rm-static, "
             "or a local json/jsonl/parquet file; several are combined")
    add("--data_split", default="2,4,4",
        help="shares of every dataset given to steps 1, 2 and 3 (disjoint, one seeded permutation)")
    add("--sft_only_data_path", nargs="*", default=[],
        help="datasets used only by step 1 (all their rows)")
    add("--data_output_path", default=None,
        help="where tokenized data are cached (default: ~/.cache/dschat-book/tokenized)")
    add("--model_name_or_path", default="cpu-tiny",
        help="an architecture name (built from config, random init), a local checkpoint or a Hub id")
    add("--tokenizer_name_or_path", default=None,
        help="default: the tokenizer saved beside the model, else the shipped one")
    add("--per_device_eval_batch_size", type=int, default=64, help="eval batch size per rank")
    add("--max_seq_len", type=int, default=64, help="prompt + response tokens; longer rows are dropped and counted")
    add("--num_train_epochs", type=int, default=1, help="passes over the step-1 share of the data")
    add("--max_steps", type=int, default=None, help="stop after this many micro-batches (default: all epochs)")
    add("--mask_prompt", action=argparse.BooleanOptionalAction, default=True,
        help="leave prompt tokens out of the loss (--no-mask_prompt scores them, as DeepSpeed-Chat does)")
    add("--dropout", type=float, default=0.0, help="dropout probability of every dropout layer")
    add("--eval_interval", type=int, default=0, help="optimizer steps between eval-perplexity checks (0: end only)")
    add("--num_eval_prompts", type=int, default=DEFAULT_NUM_EVAL_PROMPTS,
        help="prompts answered greedily and scored by the ground truth (shipped task only)")
    add("--output_dir", required=True, help="where the model, tokenizer and report.json go")
    engine.add_train_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run step 1 from the command line; see :func:`build_parser` for the options."""
    import torch.distributed as dist

    from dschat_lib import data, lora, models, pipeline, runtime, tasks
    from dschat_lib.engine import settings_from_args

    args = build_parser().parse_args(argv)
    runtime.seed_everything(args.seed)
    runtime.init_distributed()
    world_size = dist.get_world_size()
    tokenizer = pipeline.load_tokenizer_for(args.model_name_or_path, args.tokenizer_name_or_path)
    cache = {"cache_dir": args.data_output_path} if args.data_output_path else {}
    phase = data.build_phase_data(1, tokenizer, args.data_path, data_split=args.data_split,
                                  seed=args.seed, max_seq_len=args.max_seq_len,
                                  mask_prompt=args.mask_prompt, sft_only=args.sft_only_data_path, **cache)
    loader = pipeline.distributed_loader(phase.train, phase.collator, args.per_device_train_batch_size,
                                         args.seed)
    eval_items = phase.eval.items[:DEFAULT_NUM_EVAL_SEQUENCES]
    size = args.per_device_eval_batch_size
    eval_batches = [phase.collator(eval_items[i:i + size]) for i in range(0, len(eval_items), size)]
    has_truth = all(str(source) == data.SHIPPED for source in args.data_path)
    prompts = [row["prompt"] for row in phase.eval_rows[:args.num_eval_prompts]] if has_truth else []

    model = models.create_hf_model(args.model_name_or_path, tokenizer, seed=args.seed, dropout=args.dropout)
    settings = settings_from_args(args, job_name="step1_sft")
    engine, report = train_sft(model, tokenizer, loader, eval_batches, settings,
                               num_train_epochs=args.num_train_epochs, max_micro_steps=args.max_steps,
                               eval_prompts=prompts, scorer=tasks.score if has_truth else None,
                               eval_every=args.eval_interval, world_size=world_size,
                               progress=dist.get_rank() == 0)
    # LoRA adapters are folded into the weights, so the saved model is a plain HF model.
    to_save = lora.merge(engine.module, settings.zero_stage) if settings.lora.enabled else engine
    models.save_hf_model(to_save, args.output_dir, tokenizer)
    summary = {"step": 1, "args": vars(args), "world_size": world_size, "data": phase.stats,
               "ppl_before": report.ppl_before, "ppl_after": report.ppl_after,
               "truth_before": report.truth_before, "truth_after": report.truth_after,
               "final_loss": report.history[-1]["loss"], "micro_steps": len(report.history)}
    pipeline.finish_rank(args.output_dir, summary, engine)
    if dist.get_rank() == 0:
        print(f"step 1 done: perplexity {report.ppl_before:.2f} -> {report.ppl_after:.2f}"
              + (f", ground truth {report.truth_before:.3f} -> {report.truth_after:.3f}" if has_truth else "")
              + f"; saved to {args.output_dir}")
    return 0


# =========================================================================== chapter experiments

def train_preset_briefly(preset, tokenizer, eval_batches: Sequence[dict], prompts: Sequence[str],
                         mask_prompt: bool, max_micro_steps: int, seed: int,
                         monitor_dir: str | None = None, progress: bool = True, **setting_changes):
    """A short step-1 run of a preset, measured on the given (response-only) eval batches and
    prompts. Returns ``(engine, SFTReport)``; the caller tears the engine down. Used to compare
    choices at equal steps: prompt masking, or — through ``setting_changes`` such as
    ``lora_dim=8`` — LoRA variants."""
    from dschat_lib import data, models, pipeline, runtime, tasks

    runtime.seed_everything(seed)
    runtime.init_distributed()
    phase = data.build_phase_data(1, tokenizer, preset.data, data_split=preset.data_split, seed=seed,
                                  max_seq_len=preset.max_seq_len, mask_prompt=mask_prompt)
    loader = data.dataloader(phase, preset.micro_batch_size, seed=seed)
    model = models.create_hf_model(preset.actor_model, tokenizer, seed=seed)
    settings = pipeline.train_settings(preset, preset.sft_learning_rate, seed=seed,
                                       monitor_dir=monitor_dir,
                                       job_name="masked" if mask_prompt else "unmasked",
                                       **setting_changes)
    return train_sft(model, tokenizer, loader, eval_batches, settings, max_micro_steps=max_micro_steps,
                     eval_prompts=prompts, scorer=tasks.score, progress=progress)
