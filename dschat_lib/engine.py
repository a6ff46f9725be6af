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


def build_ds_config(settings: TrainSettings, world_size: int | None = None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config these settings describe (optimizer comes from the param groups);
    ``extra`` is merged in last (e.g. the actor's hybrid-engine block)."""
    offload_optimizer = "cpu" if settings.offload and settings.zero_stage > 0 else None
    offload_param = "cpu" if settings.offload and settings.zero_stage == 3 else None
    return ds_config_lib.ds_config(
        stage=settings.zero_stage, micro_batch_size=settings.per_device_train_batch_size,
        gradient_accumulation_steps=settings.gradient_accumulation_steps, world_size=world_size,
        dtype=settings.dtype, offload_optimizer=offload_optimizer, offload_param=offload_param,
        gradient_clipping=settings.gradient_clipping,
        optimizer=ds_config_lib.adamw(settings.learning_rate, settings.weight_decay, ADAM_BETAS),
        monitor_dir=settings.monitor_dir, job_name=settings.job_name, extra=extra)


def build_train_engine(model: torch.nn.Module, settings: TrainSettings, num_training_steps: int,
                       world_size: int | None = None, extra_config: dict[str, Any] | None = None):
    """LoRA (if asked), gradient checkpointing (if asked), parameter groups, schedule, engine.

    ``num_training_steps`` counts optimizer steps; the schedule decays over exactly that many.
    ``extra_config`` is merged into the DeepSpeed config (see :func:`build_ds_config`).
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
                                      config=build_ds_config(settings, world_size, extra_config),
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


# --------------------------------------------------------------------------- command line

def add_train_arguments(parser, prefix: str = "", defaults: TrainSettings | None = None) -> None:
    """Add the :class:`TrainSettings` options to an argparse parser, named like DeepSpeed-Chat's.

    ``prefix`` ("actor_", "critic_") gives step 3 one set per trained model. Flags that are
    per-run rather than per-model (``--dtype``, ``--offload``, ``--seed``, batch sizes) are
    added only without a prefix.
    """
    d = defaults or TrainSettings()
    p = prefix
    parser.add_argument(f"--{p}learning_rate", type=float, default=d.learning_rate,
                        help="initial learning rate (after warm-up)")
    parser.add_argument(f"--{p}weight_decay", type=float, default=d.weight_decay,
                        help="AdamW weight decay; never applied to biases or norm weights")
    parser.add_argument(f"--{p}zero_stage", type=int, default=d.zero_stage, choices=(0, 1, 2, 3),
                        help="ZeRO stage: 1 partitions optimizer state, 2 also gradients, 3 also parameters")
    parser.add_argument(f"--{p}gradient_checkpointing", action="store_true",
                        default=d.gradient_checkpointing,
                        help="recompute activations during backward to save memory")
    parser.add_argument(f"--{p}lora_dim", type=int, default=d.lora.dim,
                        help="LoRA rank r; 0 disables LoRA")
    parser.add_argument(f"--{p}lora_module_name", default=d.lora.module_name,
                        help="LoRA adapts linear layers whose name contains this")
    parser.add_argument(f"--{p}lora_learning_rate", type=float, default=d.lora.learning_rate,
                        help="learning rate of the LoRA weights (default: the base rate)")
    if prefix:
        return
    parser.add_argument("--per_device_train_batch_size", type=int, default=d.per_device_train_batch_size,
                        help="micro-batch size per rank")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=d.gradient_accumulation_steps,
                        help="micro-batches per optimizer step")
    parser.add_argument("--lr_scheduler_type", default=d.lr_scheduler_type, choices=LR_SCHEDULER_TYPES,
                        help="learning-rate schedule after warm-up")
    parser.add_argument("--num_warmup_steps", type=int, default=d.num_warmup_steps,
                        help="optimizer steps of linear warm-up")
    parser.add_argument("--only_optimize_lora", action="store_true", default=d.lora.only_optimize_lora,
                        help="train only the LoRA weights (default when --lora_dim > 0)")
    parser.add_argument("--train_base_with_lora", dest="only_optimize_lora", action="store_false",
                        help="with LoRA, also train the base weights (LoRA plus full fine-tuning)")
    parser.add_argument("--offload", action="store_true", default=d.offload,
                        help="offload optimizer state (and at ZeRO-3 parameters) to CPU memory")
    parser.add_argument("--dtype", default=d.dtype, choices=("fp32", "fp16", "bf16"),
                        help="training precision")
    parser.add_argument("--gradient_clipping", type=float, default=d.gradient_clipping,
                        help="clip the global gradient norm to this value")
    parser.add_argument("--enable_tensorboard", action="store_true",
                        help="log metrics to TensorBoard and CSV through DeepSpeed's monitor")
    parser.add_argument("--tensorboard_path", default=None,
                        help="where monitor logs go (default: OUTPUT_DIR/logs)")
    parser.add_argument("--seed", type=int, default=d.seed, help="random seed")
    parser.add_argument("--local_rank", type=int, default=-1,
                        help="set by the deepspeed launcher; the LOCAL_RANK variable is used instead")


def settings_from_args(args, prefix: str = "", job_name: str = "dschat",
                       micro_batch_size: int | None = None, monitor: bool = True) -> TrainSettings:
    """The :class:`TrainSettings` that parsed arguments describe (see :func:`add_train_arguments`).

    ``micro_batch_size`` overrides ``--per_device_train_batch_size`` (step 3 names its own);
    ``monitor=False`` keeps this model out of the TensorBoard/CSV logs.
    """
    def get(name):
        return getattr(args, prefix + name)

    monitor_dir = None
    if args.enable_tensorboard and monitor:
        monitor_dir = args.tensorboard_path or f"{args.output_dir}/logs"
    return TrainSettings(
        per_device_train_batch_size=micro_batch_size or args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=get("learning_rate"), weight_decay=get("weight_decay"),
        lr_scheduler_type=args.lr_scheduler_type, num_warmup_steps=args.num_warmup_steps,
        zero_stage=get("zero_stage"), offload=args.offload, dtype=args.dtype,
        gradient_clipping=args.gradient_clipping, gradient_checkpointing=get("gradient_checkpointing"),
        lora=lora_lib.LoraSettings(dim=get("lora_dim"), module_name=get("lora_module_name"),
                                   only_optimize_lora=args.only_optimize_lora,
                                   learning_rate=get("lora_learning_rate")),
        monitor_dir=monitor_dir, job_name=job_name, seed=args.seed)
