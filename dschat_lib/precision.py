"""Floating-point formats for training, and what they do to gradients and updates.

Facts come from ``torch.finfo`` (IEEE 754 binary32/binary16 and Google's bfloat16), not from a
table typed by hand. The two demonstrations measure the two failure modes mixed precision
guards against:

- *small gradients* underflow to zero in fp16 (dynamic loss scaling multiplies them back into
  range before backward, and divides them out in fp32 before the update);
- *small updates* vanish when added to a 16-bit weight, because the spacing between 16-bit
  numbers near the weight is larger than the update (so the optimizer updates an fp32 master
  copy and only rounds to 16 bits for the forward pass).

The loss-scale helpers read the per-step history ``training.run_steps`` records for fp16
engines (``loss_scale`` and ``skipped``).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

FORMATS: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

#: Stored bits (sign, exponent, mantissa) of each format.
BITS: dict[str, tuple[int, int, int]] = {"fp32": (1, 8, 23), "fp16": (1, 5, 10), "bf16": (1, 8, 7)}


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The smallest positive number the format can store: 2^(min normal exponent − mantissa bits)."""
    info = torch.finfo(dtype)
    mantissa_bits = BITS[_name(dtype)][2]
    return math.ldexp(1.0, round(math.log2(info.tiny)) - mantissa_bits)


def _name(dtype: torch.dtype) -> str:
    return {v: k for k, v in FORMATS.items()}[dtype]


def spacing(x: float, dtype: torch.dtype) -> float:
    """Distance from ``x`` (rounded to ``dtype``) to the next larger number of the format."""
    value = torch.tensor(x, dtype=dtype)
    return float(torch.nextafter(value, torch.tensor(math.inf, dtype=dtype)) - value)


def format_facts() -> "object":
    """A DataFrame of range and precision per format, all computed."""
    import pandas as pd

    rows = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        sign, exponent, mantissa = BITS[name]
        rows[name] = {"bits": sign + exponent + mantissa, "exponent bits": exponent,
                      "mantissa bits": mantissa, "largest finite": float(info.max),
                      "smallest normal": float(info.tiny),
                      "smallest subnormal": smallest_subnormal(dtype),
                      "spacing near 1": spacing(1.0, dtype)}
    return pd.DataFrame.from_dict(rows, orient="index")


# --------------------------------------------------------------------------- small gradients

def underflow_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Fraction of the nonzero ``values`` that become exactly zero when ``scale·value`` is
    stored in ``dtype`` (what happens to unscaled or loss-scaled gradients in 16 bits)."""
    nonzero = values[values != 0].double()
    if nonzero.numel() == 0:
        return 0.0
    stored = (nonzero * scale).to(dtype)
    return float((stored == 0).double().mean())


def overflow_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Fraction of ``values`` that become inf when ``scale·value`` is stored in ``dtype``."""
    stored = (values.double() * scale).to(dtype)
    return float(torch.isinf(stored).double().mean())


# --------------------------------------------------------------------------- small updates

def lost_update_fraction(weights: torch.Tensor, updates: torch.Tensor, dtype: torch.dtype) -> float:
    """Among elements with a nonzero update, the fraction where ``weight + update`` rounded to
    ``dtype`` equals the weight rounded to ``dtype``: the update was lost to rounding."""
    moving = updates != 0
    w = weights[moving].to(dtype)
    if w.numel() == 0:
        return 0.0
    return float(((w.double() + updates[moving].double()).to(dtype) == w).double().mean())


def repeated_update(start: float, update: float, steps: int, dtype: torch.dtype) -> dict[str, list[float]]:
    """Apply the same small ``update`` ``steps`` times to one weight, two ways:

    - ``pure``: the weight lives in ``dtype`` and each sum is rounded back to ``dtype``;
    - ``master``: an fp32 master weight accumulates the updates, and the ``dtype`` copy the
      model would compute with is rounded from it (what DeepSpeed's mixed precision does).
    """
    pure = torch.tensor(start, dtype=dtype)
    master = torch.tensor(start, dtype=torch.float32)
    trace = {"pure": [float(pure)], "master": [float(master)], "master_rounded": [float(master.to(dtype))]}
    for _ in range(steps):
        pure = (pure.float() + update).to(dtype)
        master = master + update
        trace["pure"].append(float(pure))
        trace["master"].append(float(master))
        trace["master_rounded"].append(float(master.to(dtype)))
    return trace


# --------------------------------------------------------------------------- loss-scale traces

def current_loss_scale(optimizer) -> float:
    """The loss scale an fp16 optimizer wrapper will apply next. The ZeRO wrappers expose it
    as ``cur_scale``; ZeRO-0's fused ``FP16_Optimizer`` keeps it in ``loss_scale_config``."""
    if hasattr(optimizer, "cur_scale"):
        return float(optimizer.cur_scale)
    return float(optimizer.loss_scale_config.cur_scale)


def train_fp16(engine, batches: Iterable[dict[str, torch.Tensor]], num_steps: int) -> list[dict]:
    """Train an fp16 engine and record, per step: loss, the loss scale after the step, and
    DeepSpeed's running count of skipped steps (``engine.skipped_steps``) — the rows
    :func:`dschat_lib.training.run_steps` writes for an fp16 engine."""
    from dschat_lib import training  # imported here: training imports this module

    if not engine.fp16_enabled():
        raise ValueError("train_fp16 needs an engine with fp16 enabled (its config's fp16 block); "
                         "without it there is no loss scale to record")
    return training.run_steps(engine, batches, num_steps, desc="fp16", progress=False)


def skipped_steps(history: Sequence[dict]) -> list[int]:
    """Micro-batch indices whose optimizer step was skipped (DeepSpeed's counter went up)."""
    previous, out = 0, []
    for row in history:
        if row["skipped"] > previous:
            out.append(row["step"])
        previous = row["skipped"]
    return out


def scale_changes(history: Sequence[dict], initial_scale: float) -> list[dict]:
    """Every step where the loss scale changed: step, old and new scale, and whether that
    step was skipped (a decrease follows an overflow; an increase follows a clean window)."""
    skipped = set(skipped_steps(history))
    out, previous = [], initial_scale
    for row in history:
        if row["loss_scale"] != previous:
            out.append({"step": row["step"], "from": previous, "to": row["loss_scale"],
                        "ratio": row["loss_scale"] / previous, "skipped": row["step"] in skipped})
        previous = row["loss_scale"]
    return out


def scale_ratio_after_first_overflow(history: Sequence[dict], initial_scale: float) -> float:
    """Loss scale right after the first skipped step divided by the scale just before it."""
    skipped = set(skipped_steps(history))
    for i, row in enumerate(history):
        if row["step"] in skipped:
            before = initial_scale if i == 0 else history[i - 1]["loss_scale"]
            return row["loss_scale"] / before
    raise ValueError("no step was skipped: there was no overflow to react to")


def fp16_config(initial_scale_power: int, loss_scale_window: int, hysteresis: int = 1,
                static_loss_scale: float = 0, min_loss_scale: float = 1) -> dict:
    """The ``fp16`` block of a DeepSpeed config, every key spelled out.

    ``loss_scale`` 0 means dynamic scaling starting at ``2**initial_scale_power``; any other
    value is a fixed scale. ``loss_scale_window``: clean steps before the scale doubles.
    ``hysteresis``: overflows tolerated before the scale halves (honoured by the ZeRO
    optimizers; ZeRO-0's fused fp16 optimizer halves on every overflow).
    """
    return {"enabled": True, "loss_scale": static_loss_scale, "initial_scale_power": initial_scale_power,
            "loss_scale_window": loss_scale_window, "hysteresis": hysteresis,
            "min_loss_scale": min_loss_scale}


# --------------------------------------------------------------------------- fp16 on CPUs

def fp16_natively_supported() -> bool:
    """Whether DeepSpeed's accelerator says fp16 is supported (on CPU: oneDNN has native fp16
    kernels, i.e. the CPU has AVX512-FP16 or AMX-FP16)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def lift_cpu_fp16_gate() -> bool:
    """Let DeepSpeed build and train fp16 engines in this process on a CPU without native fp16
    kernels; return True when the gate had to be lifted.

    DeepSpeed's CPU accelerator reports fp16 as unsupported unless oneDNN has native fp16
    kernels (AVX512-FP16 or AMX-FP16), and then refuses fp16 engines (at ``initialize`` and
    again when it reduces gradients). PyTorch still computes in fp16 on any CPU, only more
    slowly, and the loss-scaling code under study is the same code a GPU runs. So the precision
    chapter lifts that one gate, in its own process, and says so. On GPUs, or CPUs with native
    fp16, nothing changes.
    """
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" or accelerator.is_fp16_supported():
        return False
    type(accelerator).is_fp16_supported = lambda self: True
    print("note: this CPU has no native fp16 kernels; DeepSpeed's fp16 gate is lifted in this "
          "process (PyTorch computes fp16 in software here)")
    return True
