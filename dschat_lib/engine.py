"""Turn a model and a handful of training choices into a DeepSpeed engine.

Steps 1, 2 and 3 all train this way: the same options (ZeRO stage, offload, precision, LoRA,
gradient checkpointing, learning-rate schedule, weight-decay groups, clipping) mean the same
thing in each, so they are gathered in one dataclass, :class:`TrainSettings`, whose field
names follow DeepSpeed-Chat's command-line flags where the concept is the same.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from transformers import get_scheduler

from dschat_lib import config as ds_config_lib
from dschat_lib import lora as lora_lib

LR_SCHEDULER_TYPES = ("linear", "cosine", "constant", "constant_with_warmup")
#: AdamW betas used across the book (the values InstructGPT-style runs commonly use).
ADAM_BETAS = (0.9, 0.95)


@dataclass
class TrainSettings:
    """Options shared by every training step; see each field's comment."""

    per_device_train_batch_size: int = 8   # micro-batch per rank
    gradient_accumulation_steps: int = 1   # micro-batches per optimizer step
    learning_rate: float = 1e-3
    weight_decay: float = 0.0              # applied to weights only, never biases or norms
    lr_scheduler_type: str = "cosine"      # one of LR_SCHEDULER_TYPES
    num_warmup_steps: int = 0              # optimizer steps of linear warm-up
    zero_stage: int = 0
    offload: bool = False                  # optimizer (and at ZeRO-3 parameters) to CPU
    dtype: str = "bf16"                    # fp32 | fp16 | bf16
    gradient_clipping: float | None = 1.0
    gradient_checkpointing: bool = False   # recompute activations in backward to save memory
    lora: lora_lib.LoraSettings = field(default_factory=lora_lib.LoraSettings)
    monitor_dir: str | None = None         # TensorBoard + CSV logs through DeepSpeed's monitor
    job_name: str = "dschat"
    seed: int = 1234

    def with_(self, **changes: Any) -> "TrainSettings":
        """A copy with some fields changed (``lora_dim=...`` etc. map into ``lora``)."""
        lora_changes = {k[len("lora_"):]: changes.pop(k) for k in list(changes)
                        if k.startswith("lora_") and k != "lora"}
        settings = replace(self, **changes)
        if lora_changes:
            settings = replace(settings, lora=replace(settings.lora, **lora_changes))
        return settings

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def optimizer_steps(num_micro_batches: int, gradient_accumulation_steps: int) -> int:
    """Optimizer steps taken over ``num_micro_batches`` micro-batches (per rank)."""
    return math.ceil(num_micro_batches / gradient_accumulation_steps)


def build_ds_config(settings: TrainSettings, world_size: int | None = None) -> dict[str, Any]:
    """The DeepSpeed config these settings describe (optimizer comes from the param groups)."""
    offload_optimizer = "cpu" if settings.offload and settings.zero_stage > 0 else None
    offload_param = "cpu" if settings.offload and settings.zero_stage == 3 else None
    return ds_config_lib.ds_config(
        stage=settings.zero_stage, micro_batch_size=settings.per_device_train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps, world_size=world_size,
        dtype=settings.dtype, offload_optimizer=offload_optimizer, offload_param=offload_param,
        gradient_clipping=settings.gradient_clipping,
        optimizer=ds_config_lib.adamw(settings.learning_rate, settings.weight_decay, ADAM_BETAS),
        monitor_dir=settings.monitor_dir, job_name=settings.job_name)


def build_train_engine(model: torch.nn.Module, settings: TrainSettings, num_training_steps: int,
                       world_size: int | None = None):
    """LoRA (if asked), gradient checkpointing (if asked), parameter groups, schedule, engine.

    ``num_training_steps`` counts optimizer steps; the schedule decays over exactly that many.
    Returns the DeepSpeed engine; the (possibly LoRA-wrapped) model is ``engine.module``.
    """
    import deepspeed

    if settings.lr_scheduler_type not in LR_SCHEDULER_TYPES:
        raise ValueError(f"lr_scheduler_type must be one of {LR_SCHEDULER_TYPES}, "
                         f"got {settings.lr_scheduler_type!r}")
    if num_training_steps < 1:
        raise ValueError(f"num_training_steps must be >= 1, got {num_training_steps}")
    model = lora_lib.apply_lora(model, settings.lora)
    if settings.gradient_checkpointing:
        # transformers >= 5 renamed the switch (and its keyword); accept either spelling.
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings.lora.enabled and settings.lora.only_optimize_lora:
            # Frozen embeddings produce outputs without grad; checkpointed blocks then have no
            # input needing grad and would skip LoRA's backward.
            model.enable_input_require_grads()
    groups = lora_lib.parameter_groups(model, settings.learning_rate, settings.weight_decay,
                                       settings.lora.learning_rate)
    if not groups:
        raise ValueError("no trainable parameters: check only_optimize_lora / lora_dim")

    def scheduler(optimizer):
        return get_scheduler(settings.lr_scheduler_type, optimizer,
                             num_warmup_steps=settings.num_warmup_steps,
                             num_training_steps=num_training_steps)

    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups,
                                      config=build_ds_config(settings, world_size),
                                      lr_scheduler=scheduler)
    return engine


def log_metrics(engine, metrics: dict[str, float], step: int, prefix: str = "Train") -> None:
    """Write scalar metrics through DeepSpeed's monitor (TensorBoard/CSV), when configured.

    DeepSpeed's monitors log only the learning rate by themselves; the loss and everything
    else must be written explicitly.
    """
    monitor = getattr(engine, "monitor", None)
    if monitor is not None and monitor.enabled:
        monitor.write_events([(f"{prefix}/{name}", float(value), step)
                              for name, value in metrics.items()])
