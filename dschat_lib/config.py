"""Build DeepSpeed configs (the ``ds_config`` dict) from a few named choices, and check them.

DeepSpeed reads one JSON-like dict. Most of its keys are independent, but a few only make
sense together (parameter offload needs ZeRO-3; NVMe needs a path; fp16 and bf16 exclude
each other), and DeepSpeed accepts some wrong combinations silently — ZeRO-2 with the
optimizer offloaded to NVMe simply runs without offload. :func:`ds_config` refuses those
with a message naming the argument.
"""

from __future__ import annotations

from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
DTYPES = ("fp32", "fp16", "bf16")
OFFLOAD_DEVICES = (None, "none", "cpu", "nvme")

#: Defaults in one place. Loss-scale values are DeepSpeed's own defaults, spelled out so the
#: precision chapter can point at them.
DEFAULT_GRADIENT_CLIPPING = 1.0
DEFAULT_INITIAL_SCALE_POWER = 16     # fp16 dynamic loss scale starts at 2**16
DEFAULT_LOSS_SCALE_WINDOW = 1000     # clean steps before the scale doubles again
DEFAULT_HYSTERESIS = 2               # overflows tolerated before the scale is lowered
DEFAULT_MIN_LOSS_SCALE = 1
DEFAULT_STEPS_PER_PRINT = 10_000     # keep DeepSpeed's own progress lines out of notebooks


class ConfigError(ValueError):
    """A DeepSpeed config choice that cannot work; the message names the argument."""


def ds_config(*, stage: int = 0, micro_batch_size: int = 8, gradient_accumulation_steps: int = 1,
              world_size: int | None = None, dtype: str = "bf16",
              offload_optimizer: str | None = None, offload_param: str | None = None,
              nvme_path: str | None = None, gradient_clipping: float | None = DEFAULT_GRADIENT_CLIPPING,
              initial_scale_power: int = DEFAULT_INITIAL_SCALE_POWER,
              loss_scale_window: int = DEFAULT_LOSS_SCALE_WINDOW,
              hysteresis: int = DEFAULT_HYSTERESIS,
              optimizer: dict | None = None, scheduler: dict | None = None,
              monitor_dir: str | None = None, job_name: str = "dschat",
              extra: dict | None = None) -> dict[str, Any]:
    """A validated DeepSpeed config.

    ``stage``: ZeRO stage 0–3. ``dtype``: 'fp32', 'fp16' (with dynamic loss scaling) or
    'bf16'. ``offload_optimizer``/``offload_param``: None, 'cpu' or 'nvme'. ``optimizer`` and
    ``scheduler`` are DeepSpeed's own blocks (``{"type": ..., "params": ...}``); leave them out
    when you pass a torch optimizer to ``deepspeed.initialize``. ``world_size``, when given,
    lets the config state ``train_batch_size`` too. ``monitor_dir`` turns on DeepSpeed's
    TensorBoard and CSV monitors there. ``extra`` is merged in last, for keys not covered here.
    """
    if stage not in ZERO_STAGES:
        raise ConfigError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, value in (("micro_batch_size", micro_batch_size),
                        ("gradient_accumulation_steps", gradient_accumulation_steps)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    offload_optimizer = None if offload_optimizer == "none" else offload_optimizer
    offload_param = None if offload_param == "none" else offload_param
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)):
        if value not in OFFLOAD_DEVICES:
            raise ConfigError(f"{name} must be one of {OFFLOAD_DEVICES}, got {value!r}")
    if offload_optimizer and stage == 0:
        raise ConfigError("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage=0 has no "
                          "partitioned optimizer to offload)")
    if offload_optimizer == "nvme" and stage != 3:
        # DeepSpeed accepts this at stage 1/2 and silently keeps the optimizer in memory.
        raise ConfigError(f"offload_optimizer='nvme' needs stage=3 (got stage={stage}); "
                          "use offload_optimizer='cpu' at stages 1-2")
    if offload_param and stage != 3:
        raise ConfigError(f"offload_param needs stage=3 (got stage={stage}): only ZeRO-3 "
                          "partitions the parameters themselves")
    if "nvme" in (offload_optimizer, offload_param) and not nvme_path:
        raise ConfigError("NVMe offload needs nvme_path, a directory on a fast local disk")

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": DEFAULT_STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": stage},
    }
    if world_size is not None:
        config["train_batch_size"] = micro_batch_size * gradient_accumulation_steps * world_size
    if gradient_clipping is not None:
        config["gradient_clipping"] = gradient_clipping
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0,  # 0 = dynamic loss scaling
                          "initial_scale_power": initial_scale_power,
                          "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
                          "min_loss_scale": DEFAULT_MIN_LOSS_SCALE}

    zero = config["zero_optimization"]
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": False}
        if offload_optimizer == "nvme":
            zero["offload_optimizer"]["nvme_path"] = str(nvme_path)
    if offload_param:
        zero["offload_param"] = {"device": offload_param, "pin_memory": False}
        if offload_param == "nvme":
            zero["offload_param"]["nvme_path"] = str(nvme_path)
            # Measured: without this, ZeRO-3 NVMe parameter offload fails to prefetch.
            zero["stage3_prefetch_bucket_size"] = 0

    if optimizer is not None:
        config["optimizer"] = optimizer
    if scheduler is not None:
        config["scheduler"] = scheduler
    if monitor_dir is not None:
        config["tensorboard"] = {"enabled": True, "output_path": str(monitor_dir), "job_name": job_name}
        config["csv_monitor"] = {"enabled": True, "output_path": str(monitor_dir), "job_name": job_name}
    if extra:
        _deep_update(config, extra)
    return config


def adamw(lr: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
          eps: float = 1e-8) -> dict[str, Any]:
    """DeepSpeed's optimizer block for AdamW."""
    return {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                        "weight_decay": weight_decay}}


def _deep_update(base: dict, update: dict) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_update(base[key], value)
        else:
            base[key] = value
