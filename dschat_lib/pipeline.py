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

def init_distributed() -> None:
    """:func:`dschat_lib.runtime.init_distributed` (kept here for the step modules that call it)."""
    runtime.init_distributed()


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
    (when :func:`dschat_lib.runtime.launch` started it) and releases its engines.

    The process group stays up: under a launcher the next step of ``e2e`` reuses it (a launched
    rank cannot rendezvous a second time).
    """
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / REPORT_FILE).write_text(json.dumps(summary, indent=1, default=str))
    if os.environ.get(runtime.RESULT_DIR_ENV):
        runtime.write_rank_result({"rank": rank, **summary})
    for engine in engines:
        engine.destroy()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# --------------------------------------------------------------------------- the steps, for notebooks

def preset_tokenizer(preset):
    """The tokenizer a preset names ("shipped": the book's own)."""
    from dschat_lib import tokenizer as tokenizer_lib

    return tokenizer_lib.load_tokenizer() if preset.tokenizer == "shipped" else \
        tokenizer_lib.load_tokenizer(preset.tokenizer)


def _data_fingerprint(preset, phase: int, seed: int) -> str:
    from dschat_lib import data

    rows = data.phase_rows(preset.data, preset.data_split, phase, seed)
    return data.fingerprint([rows.train, rows.eval])


def train_settings(preset, learning_rate: float, **changes: Any):
    """A preset's engine settings (micro-batch, precision, ZeRO stage) at ``learning_rate``."""
    from dschat_lib.engine import TrainSettings

    return TrainSettings(per_device_train_batch_size=preset.micro_batch_size,
                         learning_rate=learning_rate, dtype=preset.dtype,
                         zero_stage=preset.zero_stage, seed=preset.seed).with_(**changes)


def run_step1(preset, out_dir: str | Path, num_train_epochs: int = 1, max_steps: int | None = None,
              seed: int | None = None, progress: bool = False):
    """Step 1 for a preset: train the actor with :func:`dschat_lib.sft.train_sft` and save it
    (Hugging Face format, tokenizer beside it). Returns the :class:`~dschat_lib.sft.SFTReport`."""
    from dschat_lib import data, models, sft

    seed = preset.seed if seed is None else seed
    runtime.seed_everything(seed)
    init_distributed()
    tokenizer = preset_tokenizer(preset)
    phase = data.build_phase_data(1, tokenizer, preset.data, data_split=preset.data_split, seed=seed,
                                  max_seq_len=preset.max_seq_len)
    loader = data.dataloader(phase, preset.micro_batch_size, seed=seed)
    eval_batches = [phase.collator(phase.eval.items[i:i + 64]) for i in range(0, min(256, len(phase.eval)), 64)]
    model = models.create_hf_model(preset.actor_model, tokenizer, seed=seed)
    settings = train_settings(preset, preset.sft_learning_rate, seed=seed)
    engine, report = sft.train_sft(model, tokenizer, loader, eval_batches, settings,
                                   num_train_epochs=num_train_epochs, max_micro_steps=max_steps,
                                   progress=progress)
    models.save_hf_model(engine, str(out_dir), tokenizer)
    (Path(out_dir) / REPORT_FILE).write_text(json.dumps(
        {"history": report.history, "ppl_before": report.ppl_before, "ppl_after": report.ppl_after}))
    runtime.teardown(engine)
    return report


def sft_checkpoint(preset, num_train_epochs: int = 1, max_steps: int | None = None,
                   seed: int | None = None) -> Path:
    """The step-1 model of ``preset`` (trained once, then reused while nothing changed)."""
    from dschat_lib import artifacts

    seed = preset.seed if seed is None else seed
    key = {"preset": dict(vars(preset)), "epochs": num_train_epochs, "max_steps": max_steps,
           "seed": seed, "data": _data_fingerprint(preset, 1, seed)}
    return artifacts.cached("sft", key, lambda out: run_step1(preset, out, num_train_epochs,
                                                              max_steps, seed))


def step2_data(preset, tokenizer, seed: int | None = None, k_wise: bool = False):
    """The step-2 pairs (or the shipped K-wise groups) of a preset."""
    from dschat_lib import data

    seed = preset.seed if seed is None else seed
    if k_wise:
        return data.build_k_wise_data(tokenizer, max_seq_len=preset.max_seq_len)
    return data.build_phase_data(2, tokenizer, preset.data, data_split=preset.data_split, seed=seed,
                                 max_seq_len=preset.max_seq_len)


def run_step2(preset, sft_path: str | Path, out_dir: str | Path | None, loss: str = "pairwise",
              max_steps: int | None = None, num_train_epochs: int = 1, seed: int | None = None,
              eval_pairs: int = 256, learning_rate: float | None = None, keep_engine: bool = False,
              progress: bool = False):
    """Step 2 for a preset: a reward model initialised from the SFT model (InstructGPT), trained
    with ``loss`` and evaluated on ``eval_pairs`` held-out pairs; saved to ``out_dir`` if given.
    Returns the report, and the engine too when ``keep_engine`` (else it is torn down)."""
    from dschat_lib import models, reward

    seed = preset.seed if seed is None else seed
    runtime.seed_everything(seed)
    init_distributed()
    tokenizer = preset_tokenizer(preset)
    pairs = step2_data(preset, tokenizer, seed)
    train = step2_data(preset, tokenizer, seed, k_wise=loss == "k_wise")
    eval_items = pairs.eval.items[:eval_pairs]
    eval_batches = [pairs.collator(eval_items[i:i + 64]) for i in range(0, len(eval_items), 64)]
    # K-wise batches hold k sequences per item: fewer items keep the sequences per step equal.
    group = len(train.train.items[0]["sequences"]) // 2 if loss == "k_wise" else 1
    loader = distributed_loader(train.train, train.collator, max(1, preset.micro_batch_size // group), seed)
    model = models.create_reward_model(str(sft_path), tokenizer, seed=seed)
    settings = train_settings(preset, learning_rate or preset.reward_learning_rate, seed=seed,
                              per_device_train_batch_size=max(1, preset.micro_batch_size // group))
    engine, report = reward.train_reward_model(model, loader, eval_batches, settings, loss=loss,
                                               num_train_epochs=num_train_epochs,
                                               max_micro_steps=max_steps, progress=progress)
    if out_dir is not None:
        models.save_hf_model(engine, str(out_dir), tokenizer)
    if keep_engine:
        return report, engine
    runtime.teardown(engine)
    return report


def reward_checkpoint(preset, sft_path: str | Path, loss: str = "pairwise", max_steps: int | None = None,
                      num_train_epochs: int = 1, seed: int | None = None,
                      learning_rate: float | None = None) -> Path:
    """The step-2 model of ``preset`` on top of ``sft_path`` (trained once, then reused)."""
    from dschat_lib import artifacts

    seed = preset.seed if seed is None else seed
    key = {"preset": dict(vars(preset)), "sft": str(sft_path), "loss": loss, "max_steps": max_steps,
           "epochs": num_train_epochs, "seed": seed, "lr": learning_rate,
           "data": _data_fingerprint(preset, 2, seed)}

    def build(out):
        report = run_step2(preset, sft_path, out, loss, max_steps, num_train_epochs, seed,
                           learning_rate=learning_rate)
        (Path(out) / REPORT_FILE).write_text(json.dumps(
            {"loss": report.loss, "table": report.table(), "history": report.history,
             "before": report.before, "after": report.after}))

    return artifacts.cached("reward", key, build)


def load_report(path: str | Path) -> dict:
    """The ``report.json`` a step wrote beside its model."""
    return json.loads((Path(path) / REPORT_FILE).read_text())


def ppo_settings(preset, **changes: Any):
    """PPO settings sized by a preset (generation and mini-batch sizes, answer length)."""
    from dataclasses import replace

    from dschat_lib.ppo import PPOSettings

    settings = PPOSettings(per_device_generation_batch_size=2 * preset.micro_batch_size,
                           per_device_training_batch_size=preset.micro_batch_size,
                           max_answer_seq_len=preset.max_answer_len, seed=preset.seed)
    return replace(settings, **changes)


def step3_prompts(preset, tokenizer, batch_size: int, eval_prompts: int, seed: int | None = None):
    """Step-3 training prompts (a loader) and fixed held-out prompt batches for evaluation."""
    from dschat_lib import data

    seed = preset.seed if seed is None else seed
    phase = data.build_phase_data(3, tokenizer, preset.data, data_split=preset.data_split, seed=seed,
                                  max_prompt_len=preset.max_prompt_len)
    loader = distributed_loader(phase.train, phase.collator, batch_size, seed)
    items = phase.eval.items[:eval_prompts]
    return loader, [phase.collator(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]


def step3_ptx_loader(preset, tokenizer, batch_size: int, seed: int | None = None):
    """Step-1 batches for PPO-ptx (``PPOSettings.unsup_coef`` > 0): the language-modeling loss
    mixed into the actor's update so that chasing the reward does not unlearn the task."""
    seed = preset.seed if seed is None else seed
    return ptx_loader(tokenizer, preset.data, preset.data_split, preset.max_seq_len, batch_size, seed)


def ptx_loader(tokenizer, data_path, data_split: str, max_seq_len: int, batch_size: int, seed: int):
    """The step-1 (SFT) training share of ``data_path`` as a per-rank loader: what PPO-ptx
    mixes in, for a preset (:func:`step3_ptx_loader`) or the step-3 command line."""
    from dschat_lib import data

    phase = data.build_phase_data(1, tokenizer, data_path, data_split=data_split, seed=seed,
                                  max_seq_len=max_seq_len)
    return distributed_loader(phase.train, phase.collator, batch_size, seed)


def step3_engines(preset, sft_path: str | Path, rm_path: str | Path, settings, num_iterations: int,
                  actor_learning_rate: float | None = None, critic_learning_rate: float | None = None,
                  actor_changes: dict | None = None, critic_changes: dict | None = None):
    """The four step-3 engines: actor and reference from ``sft_path``, critic and reward model
    from ``rm_path``, with the preset's (or the given) learning rates."""
    from dschat_lib import models, ppo

    init_distributed()
    tokenizer = load_tokenizer_for(str(sft_path))
    actor_settings = train_settings(preset, actor_learning_rate or preset.actor_learning_rate,
                                    per_device_train_batch_size=settings.per_device_training_batch_size,
                                    lr_scheduler_type="constant", **(actor_changes or {}))
    critic_settings = train_settings(preset, critic_learning_rate or preset.critic_learning_rate,
                                     per_device_train_batch_size=settings.per_device_training_batch_size,
                                     lr_scheduler_type="constant", **(critic_changes or {}))
    return ppo.build_engines(models.load_hf_model(str(sft_path), tokenizer),
                             models.load_hf_model(str(sft_path), tokenizer),
                             models.load_reward_model(str(rm_path), tokenizer),
                             models.load_reward_model(str(rm_path), tokenizer),
                             settings, actor_settings, critic_settings, num_iterations)


#: What the samples in a step-3 report keep per policy (the rest of evaluate_policy's output).
EVAL_KEYS = ("reward", "truth", "well_formed", "kl", "response_len", "eos_fraction")


def add_format_share(result: dict, scorer) -> dict:
    """On the shipped task, add ``well_formed``: the share of sampled responses that are a bare
    number list (the format the task asks for; chatty answers are not)."""
    from dschat_lib import tasks

    if scorer is tasks.score:
        result["well_formed"] = tasks.well_formed_fraction(result["responses"])
    return result


def run_step3(preset, sft_path: str | Path, rm_path: str | Path, settings, num_iterations: int,
              out_dir: str | Path | None = None, eval_prompts: int = 192,
              actor_learning_rate: float | None = None, critic_learning_rate: float | None = None,
              progress: bool = False) -> dict:
    """Step 3 for a preset: PPO from the SFT model against the reward model.

    With ``settings.unsup_coef`` > 0 the actor also trains on step-1 batches (PPO-ptx).
    Samples held-out prompts before and after training (same seed), saves the actor to
    ``out_dir`` if given, and returns ``{"history", "before", "after", "samples"}``, where
    ``before``/``after`` hold :data:`EVAL_KEYS` and ``samples`` the texts side by side.
    """
    from dschat_lib import models, ppo, tasks

    runtime.seed_everything(settings.seed)
    init_distributed()
    tokenizer = load_tokenizer_for(str(sft_path))
    prompts, eval_batches = step3_prompts(preset, tokenizer, settings.per_device_generation_batch_size,
                                          eval_prompts, settings.seed)
    engines = step3_engines(preset, sft_path, rm_path, settings, num_iterations,
                            actor_learning_rate, critic_learning_rate)
    scorer = tasks.score if list(preset.data) == ["shipped"] else None
    before = add_format_share(ppo.evaluate_policy(engines, tokenizer, eval_batches, settings, scorer,
                                                  seed=settings.seed, policy=engines.ref.module), scorer)
    ptx = (step3_ptx_loader(preset, tokenizer, settings.per_device_training_batch_size, settings.seed)
           if settings.unsup_coef > 0 else None)
    history = ppo.train_ppo(engines, tokenizer, prompts, settings, num_iterations, scorer=scorer,
                            ptx_loader=ptx, progress=progress)
    after = add_format_share(ppo.evaluate_policy(engines, tokenizer, eval_batches, settings, scorer,
                                                 seed=settings.seed), scorer)
    if out_dir is not None:
        models.save_hf_model(engines.actor, str(out_dir), tokenizer)
    runtime.teardown(engines.actor, engines.ref, engines.critic, engines.reward)
    samples = [{"prompt": p, "sft": b, "rlhf": a}
               for p, b, a in zip(before["prompts"], before["responses"], after["responses"])]
    return {"history": history, "samples": samples,
            "before": {k: before[k] for k in EVAL_KEYS if k in before},
            "after": {k: after[k] for k in EVAL_KEYS if k in after}}


def rlhf_checkpoint(preset, sft_path: str | Path, rm_path: str | Path, settings, num_iterations: int,
                    eval_prompts: int = 192, actor_learning_rate: float | None = None,
                    critic_learning_rate: float | None = None) -> Path:
    """The step-3 actor (trained once, then reused), with its report (see :func:`run_step3`)."""
    from dataclasses import asdict

    from dschat_lib import artifacts

    key = {"preset": dict(vars(preset)), "sft": str(sft_path), "reward": str(rm_path),
           "settings": asdict(settings), "iterations": num_iterations, "eval_prompts": eval_prompts,
           "actor_lr": actor_learning_rate, "critic_lr": critic_learning_rate,
           "data": _data_fingerprint(preset, 3, settings.seed)}

    def build(out):
        report = run_step3(preset, sft_path, rm_path, settings, num_iterations, out, eval_prompts,
                           actor_learning_rate, critic_learning_rate)
        (Path(out) / REPORT_FILE).write_text(json.dumps(report))

    return artifacts.cached("rlhf", key, build)


def load_policy(preset, name_or_path: str | Path, tokenizer, seed: int | None = None):
    """A causal LM to compare: a saved checkpoint, or the preset's architecture at its seeded
    random init (the "base" model step 1 started from)."""
    from dschat_lib import models

    if str(name_or_path) == preset.actor_model and not Path(str(name_or_path)).exists():
        return models.create_hf_model(preset.actor_model, tokenizer,
                                      seed=preset.seed if seed is None else seed)
    return models.load_hf_model(str(name_or_path), tokenizer)


def compare_policies(preset, policies: dict[str, str | Path], sft_path: str | Path, rm_path: str | Path,
                     settings, eval_prompts: int = 192, ppl_sequences: int = 256) -> list[dict]:
    """One row per policy: perplexity on held-out step-1 answers, and — on responses sampled to
    held-out prompts with a fixed seed — the reward-model score, the ground-truth score, the KL
    to the reference (the SFT model) and the response length."""
    from dschat_lib import data, evaluation, models, ppo, tasks

    init_distributed()
    tokenizer = load_tokenizer_for(str(sft_path))
    ref = ppo.build_eval_engine(models.load_hf_model(str(sft_path), tokenizer), preset.dtype)
    scorer_model = ppo.build_eval_engine(models.load_reward_model(str(rm_path), tokenizer), preset.dtype)
    engines = ppo.Engines(actor=None, ref=ref, critic=None, reward=scorer_model)
    _, eval_batches = step3_prompts(preset, tokenizer, settings.per_device_generation_batch_size,
                                    eval_prompts, settings.seed)
    answers = data.build_phase_data(1, tokenizer, preset.data, data_split=preset.data_split,
                                    seed=settings.seed, max_seq_len=preset.max_seq_len)
    items = answers.eval.items[:ppl_sequences]
    ppl_batches = [answers.collator(items[i:i + 64]) for i in range(0, len(items), 64)]
    scorer = tasks.score if list(preset.data) == ["shipped"] else None
    rows = []
    for name, path in policies.items():
        # The same precision as the reference, so the SFT model's KL to itself is exactly 0.
        policy = load_policy(preset, path, tokenizer).to(next(ref.module.parameters()).dtype)
        result = add_format_share(ppo.evaluate_policy(engines, tokenizer, eval_batches, settings, scorer,
                                                      seed=settings.seed, policy=policy), scorer)
        rows.append({"policy": name, "perplexity": evaluation.perplexity(policy, ppl_batches),
                     **{k: result[k] for k in EVAL_KEYS if k in result}})
    runtime.teardown(ref, scorer_model)
    return rows


def chat(model_paths: dict[str, str | Path], preset, question: str, max_new_tokens: int | None = None) -> dict:
    """Each model's greedy answer to one question (wrapped in the Human/Assistant format)."""
    from dschat_lib import evaluation, tasks

    tokenizer = None
    answers = {}
    for name, path in model_paths.items():
        tokenizer = tokenizer or (load_tokenizer_for(str(path)) if Path(str(path)).exists()
                                  else preset_tokenizer(preset))
        model = load_policy(preset, path, tokenizer)
        prompt = f"{tasks.HUMAN}{question.strip()}{tasks.ASSISTANT}"
        answers[name] = evaluation.generate(model, tokenizer, [prompt],
                                            max_new_tokens=max_new_tokens or preset.max_answer_len)[0]
    return answers


# --------------------------------------------------------------------------- e2e command line

def build_parser() -> argparse.ArgumentParser:
    """``python -m dschat_lib e2e``: steps 1, 2 and 3 in sequence, each from the previous output."""
    parser = argparse.ArgumentParser(
        prog="python -m dschat_lib e2e",
        description="Run step 1 (SFT), step 2 (reward model) and step 3 (PPO) in sequence. Outputs: "
                    "OUTPUT_DIR/actor-sft, OUTPUT_DIR/reward, OUTPUT_DIR/rlhf/{actor,critic}. Options "
                    "of one step go in --step1_args/--step2_args/--step3_args (one quoted string).")
    add = parser.add_argument
    add("--data_path", nargs="*", default=["shipped"], help="datasets for all three steps")
    add("--data_split", default="2,4,4", help="shares of every dataset for steps 1,2,3")
    add("--actor_model", default="cpu-tiny",
        help="step 1's starting model: an architecture name (random init) or a checkpoint")
    add("--reward_model", default=None,
        help="step 2's starting model (default: the step-1 output, as in InstructGPT)")
    add("--actor_zero_stage", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage of steps 1 and 3's actor")
    add("--reward_zero_stage", type=int, default=0, choices=(0, 1, 2, 3),
        help="ZeRO stage of step 2 and step 3's critic")
    add("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"), help="precision of every step")
    add("--seed", type=int, default=1234, help="random seed of every step")
    add("--output_dir", required=True, help="parent directory of the three steps' outputs")
    add("--step1_args", default="", help="extra step-1 options, e.g. '--num_train_epochs 4'")
    add("--step2_args", default="", help="extra step-2 options, e.g. '--max_steps 200'")
    add("--step3_args", default="", help="extra step-3 options, e.g. '--max_iterations 30'")
    add("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Steps 1 → 2 → 3, each reading the checkpoint the previous one saved."""
    import shlex

    from dschat_lib import ppo, reward, sft

    args = build_parser().parse_args(argv)
    out = Path(args.output_dir)
    common = ["--data_path", *args.data_path, "--data_split", args.data_split, "--dtype", args.dtype,
              "--seed", str(args.seed)]
    sft_dir, reward_dir, rlhf_dir = out / "actor-sft", out / "reward", out / "rlhf"
    steps = [
        ("step 1", sft.main, [*common, "--model_name_or_path", args.actor_model,
                              "--zero_stage", str(args.actor_zero_stage), "--output_dir", str(sft_dir),
                              *shlex.split(args.step1_args)]),
        ("step 2", reward.main, [*common, "--model_name_or_path", args.reward_model or str(sft_dir),
                                 "--zero_stage", str(args.reward_zero_stage), "--output_dir", str(reward_dir),
                                 *shlex.split(args.step2_args)]),
        ("step 3", ppo.main, [*common, "--actor_model_name_or_path", str(sft_dir),
                              "--critic_model_name_or_path", str(reward_dir),
                              "--actor_zero_stage", str(args.actor_zero_stage),
                              "--critic_zero_stage", str(args.reward_zero_stage),
                              "--output_dir", str(rlhf_dir), *shlex.split(args.step3_args)]),
    ]
    for name, step_main, step_argv in steps:
        print(f"=== {name}: {' '.join(step_argv)}", flush=True)
        code = step_main(step_argv)
        if code:
            return code
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
