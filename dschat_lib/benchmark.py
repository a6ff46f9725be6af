"""Measuring training and generation speed the same way on a laptop CPU and on a GPU.

What is measured, and how:

- **Step time**: the median over ``steps`` timed optimizer steps after ``warmup`` untimed
  ones (the median, not the mean, so one burst of work by a neighbour on a shared machine
  does not move the result). CUDA work is synchronised before the clock is read.
- **samples/s** = micro-batch / step time; **tokens/s** = samples/s × sequence length.
- **Model FLOPs per token** for a training step (forward + backward) of a decoder:
  ``6·N + 12·L·H·S`` — 6 FLOPs per parameter (2 forward, 4 backward) plus the attention
  score and value products, which no parameter counts (``L`` layers, width ``H``, sequence
  ``S``; Kaplan et al. 2020, PaLM appendix B). ``N`` counts every parameter once; with a tied
  output embedding that is right, since the output projection is a real matmul. A forward
  pass alone is a third of it, ``2·N + 4·L·H·S``.
- **Reward-model step** (step 2): a sample is one chosen/rejected *pair*, two sequences, so
  tokens/s counts both; FLOPs per token as above, ``N`` the backbone plus the value head.
- **PPO iteration** (step 3): a sample is one prompt with its sampled response. Its FLOPs
  (:func:`ppo_flops_per_token`) add up every pass over the ``S`` = prompt + response tokens:
  generation (one actor forward: with a KV cache, prefill plus decoding does the matmuls of
  one forward over the whole sequence), the experience passes (actor, reference, critic and
  reward model, one forward each), then training (actor and critic, forward + backward).
- **Model TFLOP/s** = tokens/s × FLOPs per token; **MFU** = model TFLOP/s ÷ the device's peak:
  the datasheet's dense peak for known GPUs (:data:`GPU_PEAK_TFLOPS`), otherwise a measured
  large matmul on the same device and dtype (:func:`matmul_peak_tflops`) — say which.
  With LoRA the backward skips the frozen weights' gradients, so the hardware does less than
  6·N; by convention MFU still uses 6·N, which is how the recorded figures were computed too.
- **Peak memory**: tensor bytes alive at once during a step (``torch.cuda.max_memory_allocated``
  on a GPU; on a CPU the measurement of :mod:`dschat_lib.autotune`).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from typing import Callable

import torch

from dschat_lib import autotune, config, models, runtime, training

#: Dense (no sparsity) peak TFLOP/s of 16-bit tensor-core math, from NVIDIA's datasheets,
#: keyed by a substring of ``torch.cuda.get_device_name()``. Checked in order, so the more
#: specific names come first.
GPU_PEAK_TFLOPS = (
    ("H200", {"bf16": 989.0, "fp16": 989.0}),
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0}),
    ("H100", {"bf16": 989.0, "fp16": 989.0}),       # SXM
    ("A100", {"bf16": 312.0, "fp16": 312.0}),
    ("L40S", {"bf16": 362.0, "fp16": 362.0}),
    ("A10G", {"bf16": 70.0, "fp16": 70.0}),
)

#: The step-1 (SFT) figure a DeepSpeed-Chat user recorded for OPT-1.3B on one GPU (GPU model
#: not recorded): fp16, micro-batch 8 × 512 tokens, LoRA dim 128, ZeRO-0, DeepSpeed 0.9.5.
RECORDED_OPT_1_3B_SFT = {"seconds_per_micro_batch": 0.33, "samples_per_s": 24.0, "tflops": 70.0,
                         "dtype": "fp16", "micro_batch_size": 8, "seq_len": 512, "lora_dim": 128,
                         "stage": 0}


def forward_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Forward FLOPs per token: 2·N + 4·L·H·S (see the module docstring)."""
    return 2.0 * num_params + 4.0 * num_layers * hidden_size * seq_len


def training_flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    """Forward+backward FLOPs per token: 6·N + 12·L·H·S, three forwards' worth (the backward
    computes gradients for both the activations and the weights: twice the forward)."""
    return 3.0 * forward_flops_per_token(num_params, num_layers, hidden_size, seq_len)


def ppo_flops_per_token(actor: dict, critic: dict, seq_len: int) -> float:
    """Model FLOPs per token of one PPO iteration, for ``actor``/``critic`` shapes (dicts with
    ``num_params, num_layers, hidden_size``; the reference has the actor's shape, the reward
    model the critic's): generation 1 actor forward, experience 2 actor-shaped + 2
    critic-shaped forwards, training 1 actor + 1 critic forward+backward: six actor-shaped
    and five critic-shaped forwards in all."""
    def forward(shape: dict) -> float:
        return forward_flops_per_token(shape["num_params"], shape["num_layers"], shape["hidden_size"], seq_len)

    generation = forward(actor)
    experience = 2 * forward(actor) + 2 * forward(critic)
    training = 3 * forward(actor) + 3 * forward(critic)
    return generation + experience + training


def peak_tflops(dtype: str, device: torch.device | None = None) -> tuple[float, str]:
    """The MFU denominator and where it came from: ``(tflops, "datasheet: H100")`` or
    ``(tflops, "measured matmul")``."""
    device = device or runtime.device()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_TFLOPS:
            if key in name and dtype in peaks:
                return peaks[dtype], f"datasheet: {key}"
    return matmul_peak_tflops(dtype, device), "measured matmul"


def matmul_peak_tflops(dtype: str, device: torch.device | None = None, size: int | None = None,
                       repeats: int = 5) -> float:
    """TFLOP/s of the best of ``repeats`` square matmuls of ``size`` in ``dtype`` — a practical
    ceiling where no datasheet figure applies (a CPU)."""
    device = device or runtime.device()
    size = size or (8192 if device.type == "cuda" else 1024)
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    b = torch.randn(size, size, device=device, dtype=torch_dtype)
    best = float("inf")
    for _ in range(repeats + 1):            # the first run warms up kernels and caches
        synchronize(device)
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e12


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def environment() -> dict:
    """Hardware, versions and the machine's load while benchmarking (timings on a shared
    machine are only comparable with the load they were taken under)."""
    report = runtime.environment_report()
    report.update(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                  cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                  load_average_1_5_15=[round(x, 2) for x in os.getloadavg()],
                  date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
    return report


# --------------------------------------------------------------------------- training steps

def _apply_lora(model: torch.nn.Module, lora_dim: int) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    return get_peft_model(model, LoraConfig(r=lora_dim, lora_alpha=lora_dim, target_modules=targets,
                                            lora_dropout=0.0, bias="none"))


def model_shape(model: torch.nn.Module) -> dict:
    """What the FLOP formulas need: parameter count, layers, width. A
    :class:`~dschat_lib.models.RewardModel` shares its backbone's config, so its count adds
    the value head to the backbone's."""
    cfg = model.config
    return {"num_params": models.parameter_count(model), "num_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size}


def _build(case: dict) -> tuple[torch.nn.Module, dict]:
    model = models.build_causal_lm(case["arch"], vocab_size=case["vocab_size"], seed=case.get("seed", 0))
    if case.get("gradient_checkpointing"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = model_shape(model)
    if case.get("lora_dim"):
        model = _apply_lora(model, case["lora_dim"])
    return model, shape


def _optimizer(model: torch.nn.Module, case: dict) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # fused=True runs AdamW as a few large CUDA kernels instead of one per tensor.
    fused = runtime.device().type == "cuda" and case.get("fused_adamw", True)
    return torch.optim.AdamW(params, lr=1e-4, fused=fused)


def timed(step: Callable[[], None], steps: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        step()
    synchronize(device)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    return seconds


def summarise(case: dict, shape: dict, seconds: list[float], peak_bytes: int, peak: tuple[float, str],
              sequences_per_sample: int = 1, flops_per_token: float | None = None) -> dict:
    """One benchmark row: the median step time and what follows from it (module docstring).
    ``sequences_per_sample``: 2 for a preference pair; ``flops_per_token`` defaults to a
    training step's."""
    step_s = statistics.median(seconds)
    samples = case["micro_batch_size"] / step_s
    tokens = samples * case["seq_len"] * sequences_per_sample
    flops = flops_per_token or training_flops_per_token(shape["num_params"], shape["num_layers"],
                                                        shape["hidden_size"], case["seq_len"])
    tflops = tokens * flops / 1e12
    return {**case, **shape, "step_s": step_s, "step_s_all": seconds, "samples_per_s": samples,
            "tokens_per_s": tokens, "flops_per_token": flops, "model_tflops": tflops,
            "peak_tflops": peak[0], "peak_source": peak[1], "mfu": tflops / peak[0],
            "peak_memory_bytes": int(peak_bytes)}


def memory_start(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    return autotune.live_tensor_bytes()


def memory_peak(device: torch.device, baseline: int, step: Callable[[], None]) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) - baseline
    return autotune.live_tensor_bytes() - baseline + autotune.transient_peak_bytes(step)


def deepspeed_step(case: dict, steps: int = 5, warmup: int = 2) -> dict:
    """Time a causal-LM training step (SFT's step) of a DeepSpeed engine built from ``case``:
    ``arch, vocab_size, seq_len, micro_batch_size, dtype, stage`` and optional ``lora_dim``,
    ``gradient_checkpointing``."""
    batches = training.counting_batches(case["vocab_size"], case["micro_batch_size"], case["seq_len"])
    return engine_step(case, lambda: _build(case), lambda engine, batch: engine(**batch).loss,
                       batches, steps, warmup)


def engine_step(case: dict, build: Callable[[], tuple[torch.nn.Module, dict]],
                loss_fn: Callable[[object, dict], torch.Tensor], batches, steps: int, warmup: int,
                sequences_per_sample: int = 1) -> dict:
    """Time ``engine.backward(loss_fn(engine, batch)); engine.step()`` on a DeepSpeed engine
    wrapping ``build()``'s model as ``case`` says (stage, dtype, micro-batch), with the same
    optimizer as the plain-PyTorch baseline. Memory is counted from before the model exists."""
    import deepspeed

    device = runtime.device()
    runtime.init_distributed()
    baseline = memory_start(device)
    model, shape = build()
    optimizer = _optimizer(model, case)
    cfg = config.ds_config(stage=case.get("stage", 0), micro_batch_size=case["micro_batch_size"],
                           dtype=case["dtype"], extra={"zero_allow_untested_optimizer": True})
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)

    def step() -> None:
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        engine.backward(loss_fn(engine, batch))
        engine.step()

    try:
        seconds = timed(step, steps, warmup, device)
        peak_bytes = memory_peak(device, baseline, step)
    finally:
        runtime.teardown(engine)
        del engine, optimizer, model
        gc.collect()
    return summarise({**case, "runner": f"deepspeed ZeRO-{case.get('stage', 0)}"}, shape, seconds,
                     peak_bytes, peak_tflops(case["dtype"], device), sequences_per_sample)


def plain_pytorch_step(case: dict, steps: int = 5, warmup: int = 2) -> dict:
    """The same step as :func:`deepspeed_step` written as a plain PyTorch loop: the model in
    ``dtype`` under autocast when 16-bit (fp32 master weights), AdamW, gradient clipping at
    the same norm DeepSpeed's config uses. The baseline for DeepSpeed's overhead."""
    device = runtime.device()
    baseline = memory_start(device)
    model, shape = _build(case)
    model.to(device)
    optimizer = _optimizer(model, case)
    batches = training.counting_batches(case["vocab_size"], case["micro_batch_size"], case["seq_len"])
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case["dtype"])
    scaler = torch.amp.GradScaler(device.type, enabled=case["dtype"] == "fp16")
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        batch = {k: v.to(device) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=half or torch.float32, enabled=half is not None):
            loss = model(**batch).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, config.DEFAULT_GRADIENT_CLIPPING)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    try:
        seconds = timed(step, steps, warmup, device)
        peak_bytes = memory_peak(device, baseline, step)
    finally:
        del optimizer, model
        gc.collect()
    return summarise({**case, "runner": "plain PyTorch"}, shape, seconds, peak_bytes,
                      peak_tflops(case["dtype"], device))


# --------------------------------------------------------------------------- generation

def generation_speed(module: torch.nn.Module, vocab_size: int, batch_size: int, prompt_len: int,
                     new_tokens: int, repeats: int = 2, **generate_kwargs) -> dict:
    """New tokens per second of greedy ``module.generate`` (best of ``repeats``, after one
    warm-up call), with ``min_new_tokens`` pinned so every call does the same work."""
    device = next(module.parameters()).device
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (batch_size, prompt_len), generator=generator).to(device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0, **generate_kwargs)
    module.eval()
    best = float("inf")
    with torch.no_grad():
        for attempt in range(repeats + 1):
            synchronize(device)
            started = time.perf_counter()
            module.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **kwargs)
            synchronize(device)
            if attempt:
                best = min(best, time.perf_counter() - started)
    return {"seconds": best, "new_tokens_per_s": batch_size * new_tokens / best}


def generation_case_args(case: dict) -> list[str]:
    return [f"--{key}={value}" for key, value in case.items()]


def _zero3_generation_main() -> None:
    """``python -m dschat_lib.benchmark --arch ... `` on one or more ranks: generate from a
    plain module, from a ZeRO-3 engine, then from a full copy gathered out of the engine."""
    import argparse

    import deepspeed

    parser = argparse.ArgumentParser()
    for name in ("arch", "dtype"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("vocab_size", "batch_size", "prompt_len", "new_tokens"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    spec = dict(vocab_size=args.vocab_size, batch_size=args.batch_size, prompt_len=args.prompt_len,
                new_tokens=args.new_tokens)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    # The process group first: under the launcher, DeepSpeed's initialisation can change the
    # number of CPU threads torch uses, and all three measurements must share one setting.
    runtime.init_distributed()
    # The plain module next, in this same process and before any ZeRO-3 engine exists, so
    # the three speeds are taken close together under the same machine load.
    plain_model = models.build_causal_lm(args.arch, vocab_size=args.vocab_size, seed=0, dtype=dtype)
    plain = generation_speed(plain_model.to(runtime.device()), **spec)
    del plain_model
    model = models.build_causal_lm(args.arch, vocab_size=args.vocab_size, seed=0)
    cfg = config.ds_config(stage=3, micro_batch_size=args.batch_size, dtype=args.dtype,
                           optimizer=config.adamw(1e-4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    world = deepspeed.comm.get_world_size()
    # With more than one rank every rank must keep stepping until all have finished, or the
    # parameter gathers of the others hang: that is what synced_gpus does.
    zero3 = generation_speed(engine.module, **spec, synced_gpus=world > 1)
    started = time.perf_counter()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        gathered = models.build_causal_lm(args.arch, vocab_size=args.vocab_size, seed=0,
                                          dtype=next(engine.module.parameters()).dtype)
        gathered.load_state_dict(engine.module.state_dict())
    gather_s = time.perf_counter() - started
    gathered.to(engine.device)
    gathered_speed = generation_speed(gathered, **spec)
    # A plain module again, now built after the engine: on a machine shared with other work
    # the same module measured before and after DeepSpeed's set-up can differ widely (seen
    # here: >10x), so both are recorded rather than one chosen.
    plain_after = generation_speed(models.build_causal_lm(args.arch, vocab_size=args.vocab_size, seed=0,
                                                          dtype=dtype).to(runtime.device()), **spec)
    runtime.write_rank_result({"plain": plain, "plain_after": plain_after, "zero3": zero3, "gathered": gathered_speed,
                               "gather_s": gather_s, "world_size": world,
                               "torch_threads": torch.get_num_threads(),
                               # ZeRO-3 swaps F.linear for its memory-saving autograd function
                               # (config key memory_efficient_linear) for the whole process
                               "linear_replaced": torch.nn.functional.linear.__name__ != "linear"})
    runtime.teardown(engine)


def zero3_generation(case: dict, num_ranks: int = 1, timeout: float = 600) -> dict:
    """Run :func:`_zero3_generation_main` in its own process (a ZeRO-3 engine slows later work
    in the process that built it) and return rank 0's result: the speeds of a plain module,
    of the ZeRO-3 engine's module, and of a copy gathered out of the engine."""
    args = generation_case_args({k: case[k] for k in ("arch", "dtype", "vocab_size", "batch_size",
                                                        "prompt_len", "new_tokens")})
    return runtime.launch("dschat_lib.benchmark", args, num_ranks=num_ranks, timeout=timeout)[0]


def write_json(payload: dict, path) -> None:
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=float) + "\n")


if __name__ == "__main__":
    _zero3_generation_main()
