"""The benchmark cases, one table per suite. A case is plain data; dschat_lib.benchmark runs it.

Suites:
- ``cpu``: the book's tiny preset on a laptop CPU (what ``make bench`` records without a GPU).
- ``gpu``: the OPT-125M/350M/1.3B shapes DeepSpeed-Chat trains (random init, nothing
  downloaded), in bf16 and fp16, at 8 × 512 tokens; plus the OPT-1.3B rows compared with a
  recorded DeepSpeed-Chat run and with this book's target.
"""

from __future__ import annotations

from dschat_lib.benchmark import RECORDED_OPT_1_3B_SFT
from dschat_lib.models import OPT_VOCAB_SIZE

#: Measurement repeats: timed steps after warm-up steps (the median is reported).
CPU_STEPS, CPU_WARMUP = 5, 2
GPU_STEPS, GPU_WARMUP = 20, 5
#: The overhead ratio compares two times a few per cent apart, so it takes more steps and
#: alternates the two sides over several rounds (measured: with 5 steps x 2 rounds, repeat
#: runs on an idle 2-core machine gave -7 % and +8 %).
OVERHEAD_STEPS, OVERHEAD_WARMUP, OVERHEAD_ROUNDS = 20, 3, 3

#: Targets the suite reports against (not asserted by tests: they are for the hardware named).
TARGETS = {
    "zero0_overhead_max": 0.05,           # DeepSpeed ZeRO-0 step at most 5 % slower than plain PyTorch
    "generation_speedup_min": 5.0,        # rollouts from a plain/gathered module vs a ZeRO-3 engine
    "opt_1_3b_bf16_samples_per_s_min": 96.0,   # one H100, 8 x 512 tokens: 4x the recorded figure
    "book_cpu_minutes_max": 15.0,         # every notebook, default parameters, 2 CPU cores
}

_TINY = dict(arch="cpu-tiny", vocab_size=512, seq_len=128, micro_batch_size=8)

SUITES = {
    "cpu": {
        "sft": [dict(_TINY, name="cpu-tiny bf16", dtype="bf16", stage=0)],
        # Same math on both sides (fp32, AdamW, clipping): the ratio is DeepSpeed's own cost.
        "overhead": dict(_TINY, name="cpu-tiny fp32", dtype="fp32", stage=0),
        "generation": dict(arch="cpu-tiny", vocab_size=512, dtype="bf16", batch_size=8,
                           prompt_len=32, new_tokens=32),
        # Steps 2 and 3 at the SFT row's shape; PPO splits seq_len into prompt and response halves.
        "rlhf": {"reward model (step 2)": dict(_TINY, name="cpu-tiny bf16 reward", dtype="bf16", stage=0),
                 "PPO (step 3)": dict(_TINY, name="cpu-tiny bf16 PPO", dtype="bf16", stage=0)},
        "steps": (CPU_STEPS, CPU_WARMUP),
    },
    "gpu": {
        "sft": [
            *[dict(arch=arch, vocab_size=OPT_VOCAB_SIZE, seq_len=512, micro_batch_size=8, dtype=dtype,
                   stage=0, name=f"{arch} {dtype}")
              for arch in ("opt-125m", "opt-350m", "opt-1.3b") for dtype in ("bf16", "fp16")],
            # The recorded DeepSpeed-Chat configuration, for the like-for-like comparison.
            dict(arch="opt-1.3b", vocab_size=OPT_VOCAB_SIZE, seq_len=512,
                 micro_batch_size=RECORDED_OPT_1_3B_SFT["micro_batch_size"],
                 dtype=RECORDED_OPT_1_3B_SFT["dtype"], stage=RECORDED_OPT_1_3B_SFT["stage"],
                 lora_dim=RECORDED_OPT_1_3B_SFT["lora_dim"], name="opt-1.3b fp16 LoRA-128 (as recorded)",
                 compare_with_recorded=True),
            # Towards the target: bf16, fused AdamW, SDPA attention (transformers' default),
            # larger micro-batches; samples/s is comparable across micro-batch sizes.
            *[dict(arch="opt-1.3b", vocab_size=OPT_VOCAB_SIZE, seq_len=512, micro_batch_size=mb,
                   dtype="bf16", stage=0, name=f"opt-1.3b bf16 mb{mb} (target)", target=True)
              for mb in (8, 16, 32)],
        ],
        "overhead": dict(arch="opt-125m", vocab_size=OPT_VOCAB_SIZE, seq_len=512, micro_batch_size=8,
                         dtype="bf16", stage=0, name="opt-125m bf16"),
        "generation": dict(arch="opt-125m", vocab_size=OPT_VOCAB_SIZE, dtype="bf16", batch_size=16,
                           prompt_len=256, new_tokens=256),
        # DeepSpeed-Chat's single-GPU example pairs an OPT-1.3B actor with an OPT-350M critic
        # and reward model; 256 prompt + 256 response tokens, as its step-3 defaults.
        "rlhf": {"reward model (step 2)": dict(arch="opt-350m", vocab_size=OPT_VOCAB_SIZE, seq_len=512,
                                               micro_batch_size=8, dtype="bf16", stage=0,
                                               name="opt-350m bf16 reward"),
                 "PPO (step 3)": dict(arch="opt-1.3b", critic_arch="opt-350m", vocab_size=OPT_VOCAB_SIZE,
                                      seq_len=512, micro_batch_size=8, dtype="bf16", stage=0,
                                      name="opt-1.3b actor + opt-350m critic bf16 PPO")},
        "steps": (GPU_STEPS, GPU_WARMUP),
    },
}

#: The modules whose ``benchmark_step(case: dict, steps: int, warmup: int) -> dict`` measures
#: each RLHF row (returning at least samples_per_s, tokens_per_s, model_tflops, mfu,
#: peak_memory_bytes); the case comes from the suite's ``rlhf`` table under the same label.
PLUGGABLE_STEPS = {"reward model (step 2)": "dschat_lib.reward", "PPO (step 3)": "dschat_lib.ppo"}
