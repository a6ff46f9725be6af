"""Named run presets: the one table that says which models, data, lengths and precision a run uses.

A notebook takes ``preset`` as a papermill parameter and asks :func:`get_preset` for it, with any
overrides (``get_preset("opt-125m", data=("shipped",), tokenizer="shipped")``). Presets change
sizes, data and precision — never the code path.

A model is named either by **architecture** (a key of :data:`dschat_lib.models.ARCHITECTURES`,
built from config with random init — how the GPU shapes are exercised on a machine without the
Hugging Face Hub) or by **Hub id / local path** (real weights, loaded with ``from_pretrained``).
``"shipped"`` as data or tokenizer means the book's own list task and tokenizer under ``data/``.

The GPU presets copy the shapes of DeepSpeed-Chat's single-node examples: an OPT actor
(125m or 1.3b) with an OPT-350m reward model, ``Dahoas/rm-static`` data, sequences of 512
tokens (256 prompt + 256 answer), fp16 or bf16.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dschat_lib.models import ARCHITECTURES

SHIPPED = "shipped"
#: DeepSpeed-Chat's default share for one dataset is "2,4,4". On a CPU, step 1 is where the small
#: model learns the task itself, so the CPU presets give it a larger share; step 3 needs only
#: prompts, and a few thousand are more than a CPU run of PPO visits.
CPU_DATA_SPLIT = "4,4,2"
#: Step-3 actor learning rate of the CPU presets. Measured with cpu-tiny (30 iterations of 96
#: responses): 1e-4 barely moves the policy (clip fraction near 0); 1e-3 lowers the ground-truth
#: score within a few iterations, even with the task's own scorer as the reward; 3e-4 moves it
#: steadily with the policy clip active on a few per cent of tokens.
CPU_ACTOR_LEARNING_RATE = 3e-4


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    actor_model: str                 # architecture name, Hub id or local path (steps 1 and 3)
    reward_model: str                # the same, for the reward model / critic (steps 2 and 3)
    tokenizer: str                   # "shipped", Hub id or local path
    data: tuple[str, ...]            # "shipped", Hub dataset names or local files, combined
    data_split: str                  # shares of each dataset for steps 1, 2, 3
    max_seq_len: int                 # prompt + response, steps 1 and 2
    max_prompt_len: int              # step 3 prompts (longer ones are dropped and counted)
    max_answer_len: int              # step 3 generated tokens
    dtype: str                       # "bf16", "fp16" or "fp32"
    zero_stage: int
    micro_batch_size: int
    sft_learning_rate: float
    reward_learning_rate: float
    actor_learning_rate: float
    critic_learning_rate: float
    seed: int = 1234

    @property
    def actor_is_architecture(self) -> bool:
        return self.actor_model in ARCHITECTURES

    @property
    def reward_is_architecture(self) -> bool:
        return self.reward_model in ARCHITECTURES


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(name="cpu-tiny",
           description="The book's default: ~0.9 M-parameter OPT-shaped models built from config, "
                       "the shipped list task and tokenizer, bf16 on a 2-core CPU.",
           actor_model="cpu-tiny", reward_model="cpu-tiny", tokenizer=SHIPPED, data=(SHIPPED,),
           data_split=CPU_DATA_SPLIT, max_seq_len=64, max_prompt_len=32, max_answer_len=16,
           dtype="bf16", zero_stage=0, micro_batch_size=32,
           sft_learning_rate=1e-3, reward_learning_rate=1e-3,
           actor_learning_rate=CPU_ACTOR_LEARNING_RATE, critic_learning_rate=5e-4),
    Preset(name="llama-tiny",
           description="cpu-tiny with a Llama-style decoder (RMSNorm, rotary positions, "
                       "grouped-query attention) instead of OPT.",
           actor_model="llama-tiny", reward_model="llama-tiny", tokenizer=SHIPPED, data=(SHIPPED,),
           data_split=CPU_DATA_SPLIT, max_seq_len=64, max_prompt_len=32, max_answer_len=16,
           dtype="bf16", zero_stage=0, micro_batch_size=32,
           sft_learning_rate=1e-3, reward_learning_rate=1e-3,
           actor_learning_rate=CPU_ACTOR_LEARNING_RATE, critic_learning_rate=5e-4),
    Preset(name="opt-125m",
           description="DeepSpeed-Chat's small single-GPU shape, built from config (random "
                       "init): opt-125m actor, opt-350m reward model, rm-static, seq 512, bf16.",
           actor_model="opt-125m", reward_model="opt-350m", tokenizer="facebook/opt-125m",
           data=("Dahoas/rm-static",), data_split="2,4,4", max_seq_len=512, max_prompt_len=256,
           max_answer_len=256, dtype="bf16", zero_stage=2, micro_batch_size=8,
           sft_learning_rate=9.65e-6, reward_learning_rate=5e-6,
           actor_learning_rate=9.65e-6, critic_learning_rate=5e-6),
    Preset(name="opt-1.3b",
           description="DeepSpeed-Chat's single-node example with real weights from the Hub: "
                       "facebook/opt-1.3b actor, facebook/opt-350m reward model, rm-static, "
                       "seq 512, fp16, ZeRO-3.",
           actor_model="facebook/opt-1.3b", reward_model="facebook/opt-350m",
           tokenizer="facebook/opt-1.3b", data=("Dahoas/rm-static",), data_split="2,4,4",
           max_seq_len=512, max_prompt_len=256, max_answer_len=256, dtype="fp16", zero_stage=3,
           micro_batch_size=4, sft_learning_rate=9.65e-6, reward_learning_rate=5e-6,
           actor_learning_rate=9.65e-6, critic_learning_rate=5e-6),
    Preset(name="opt-1.3b-offline",
           description="opt-1.3b's shapes built from config (random init) on the shipped task, "
                       "for checking a GPU set-up where the Hub cannot be reached.",
           actor_model="opt-1.3b", reward_model="opt-350m", tokenizer=SHIPPED, data=(SHIPPED,),
           data_split="2,4,4", max_seq_len=512, max_prompt_len=256, max_answer_len=256,
           dtype="bf16", zero_stage=3, micro_batch_size=4,
           sft_learning_rate=9.65e-6, reward_learning_rate=5e-6,
           actor_learning_rate=9.65e-6, critic_learning_rate=5e-6),
)}

DEFAULT_PRESET = "cpu-tiny"


def get_preset(name: str = DEFAULT_PRESET, **overrides) -> Preset:
    """The preset ``name`` with ``overrides`` applied; unknown names and fields are errors."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    fields = {f.name for f in dataclasses.fields(Preset)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise TypeError(f"preset has no field(s) {unknown}; fields: {sorted(fields)}")
    if isinstance(overrides.get("data"), str):
        overrides["data"] = (overrides["data"],)
    return dataclasses.replace(PRESETS[name], **overrides)
