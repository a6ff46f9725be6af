"""LoRA on top of peft: choosing target layers, parameter groups, and merging under ZeRO-3.

LoRA (Hu et al. 2021) freezes a linear layer's weight ``W`` and learns a low-rank update:

    h = W x + (α / r) · B A x,    A ∈ R^{r×k}, B ∈ R^{d×r}, B initialised to 0

so training starts exactly at the pretrained model and only ``r (d + k)`` numbers per layer
need gradients and optimizer state. peft implements the layers; this module adds what a
DeepSpeed run needs around them: DeepSpeed-Chat-style target selection by module-name
substring, separate learning rates, and a merge that is safe under ZeRO-3 (where a rank
holds only a shard of each weight, and merging without gathering writes into empty tensors).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model

#: Default LoRA scaling numerator; with ``alpha = r`` the update is scaled by 1.
DEFAULT_LORA_ALPHA_OVER_R = 1.0
#: Names never adapted: the output head is tied to the embeddings in OPT, and adapting it
#: would also change the input embedding.
EXCLUDED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA options of a training run, named like DeepSpeed-Chat's flags.

    ``dim`` is the rank r (0 disables LoRA); ``module_name`` selects the linear layers whose
    qualified name contains it (e.g. ``"decoder.layers."``); ``only_optimize_lora`` freezes
    everything else; ``learning_rate`` is the LoRA parameters' own rate (None: the base rate).
    """

    dim: int = 0
    alpha: float | None = None
    module_name: str = "decoder.layers."
    dropout: float = 0.0
    only_optimize_lora: bool = True
    learning_rate: float | None = None

    @property
    def enabled(self) -> bool:
        return self.dim > 0


def target_linear_layers(model: torch.nn.Module, module_name: str) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers whose name contains ``module_name``."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module_name in name
             and not any(excluded in name for excluded in EXCLUDED_MODULES)]
    if not names:
        raise ValueError(f"no linear layer name contains {module_name!r}; "
                         f"some names: {[n for n, _ in model.named_modules()][:8]}")
    return names


def apply_lora(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters (a peft ``PeftModel``); a no-op when disabled.

    With ``only_optimize_lora=False`` the base weights stay trainable too ("LoRA plus full
    fine-tuning"), which costs full optimizer state but lets the adapters learn at their own
    rate on top.
    """
    if not settings.enabled:
        return model
    config = LoraConfig(r=settings.dim,
                        lora_alpha=settings.alpha if settings.alpha is not None
                        else DEFAULT_LORA_ALPHA_OVER_R * settings.dim,
                        lora_dropout=settings.dropout,
                        target_modules=target_linear_layers(model, settings.module_name),
                        bias="none")
    peft_model = get_peft_model(model, config)
    if not settings.only_optimize_lora:
        for name, param in peft_model.named_parameters():
            if "lora_" not in name:
                param.requires_grad_(True)
    return peft_model


def is_lora_parameter(name: str) -> bool:
    return "lora_A" in name or "lora_B" in name


def parameter_groups(model: torch.nn.Module, learning_rate: float, weight_decay: float,
                     lora_learning_rate: float | None = None,
                     no_decay_names: tuple[str, ...] = ("bias", "norm", "layernorm", "ln_")
                     ) -> list[dict]:
    """Optimizer groups: weight decay off for biases and norms, and LoRA weights at their
    own learning rate. Only trainable parameters are included; empty groups are dropped."""
    groups = {key: [] for key in ("decay", "no_decay", "lora_decay", "lora_no_decay")}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decays = not any(token in name.lower() for token in no_decay_names)
        prefix = "lora_" if is_lora_parameter(name) else ""
        groups[prefix + ("decay" if decays else "no_decay")].append(param)
    lora_lr = lora_learning_rate if lora_learning_rate is not None else learning_rate
    settings = {"decay": (learning_rate, weight_decay), "no_decay": (learning_rate, 0.0),
                "lora_decay": (lora_lr, weight_decay), "lora_no_decay": (lora_lr, 0.0)}
    return [{"params": params, "lr": settings[key][0], "weight_decay": settings[key][1],
             "name": key} for key, params in groups.items() if params]


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; under ZeRO-3 counts the full (``ds_numel``) sizes."""
    trainable = total = 0
    for param in model.parameters():
        numel = getattr(param, "ds_numel", param.numel())
        total += numel
        trainable += numel if param.requires_grad else 0
    return trainable, total


def lora_forward_by_hand(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``W x + b + (α/r) · B A x`` computed from a peft LoRA layer's own weights, without
    calling peft's forward: the book's check that peft computes the formula."""
    base = layer.base_layer
    out = torch.nn.functional.linear(x, base.weight, base.bias)
    for adapter in layer.active_adapters:
        a, b = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        out = out + layer.scaling[adapter] * (x @ a.T @ b.T)
    return out


def merge(model: torch.nn.Module, zero_stage: int = 0) -> torch.nn.Module:
    """Fold the adapters into the base weights and return the plain model.

    Under ZeRO-3 each rank holds a shard of every weight (the local tensors are empty), so
    the full parameters are gathered first; merging without that silently produces empty
    weights. Gathering with ``modifier_rank=0`` writes rank 0's merged values back into the
    partitions.
    """
    if not isinstance(model, PeftModel):
        return model
    if zero_stage == 3:
        import deepspeed

        context = deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0)
    else:
        context = nullcontext()
    with context:
        merged = model.merge_and_unload()
    return merged


# --------------------------------------------------------------------------- sizing

#: Bytes per parameter of model state in mixed-precision Adam training (ZeRO paper, sec. 3.1):
#: 16-bit weights (2) + 16-bit gradients (2) + fp32 master weights, momentum, variance (12).
BYTES_PER_TRAINED_PARAM = 16
#: A frozen parameter keeps only its 16-bit weights.
BYTES_PER_FROZEN_PARAM = 2


def lora_size(architecture: str, dim: int, module_name: str = "decoder.layers.",
              vocab_size: int | None = None) -> dict[str, float]:
    """Trainable parameters and model-state bytes of LoRA rank ``dim`` on an architecture.

    The model is built on PyTorch's ``meta`` device: shapes without memory, so even the
    largest architecture is sized instantly.
    """
    from dschat_lib import models

    kwargs = {"vocab_size": vocab_size} if vocab_size else {}
    with torch.device("meta"):
        model = apply_lora(models.build_causal_lm(architecture, **kwargs),
                           LoraSettings(dim=dim, module_name=module_name))
    trainable, total = trainable_parameters(model)
    frozen = total - trainable
    full_bytes = (total - trainable) * BYTES_PER_TRAINED_PARAM     # fine-tuning the base model
    lora_bytes = trainable * BYTES_PER_TRAINED_PARAM + frozen * BYTES_PER_FROZEN_PARAM
    return {"architecture": architecture, "lora_dim": dim, "module_name": module_name,
            "trainable": trainable, "total": total, "trainable_fraction": trainable / total,
            "full_finetune_state_gb": full_bytes / 1e9, "lora_state_gb": lora_bytes / 1e9,
            "state_ratio": lora_bytes / full_bytes}


# --------------------------------------------------------------------------- ZeRO-3 demonstration

def zero3_merge_check(seed: int = 0, vocab_size: int = 64, rank: int = 4) -> dict:
    """Merge LoRA adapters inside a ZeRO-3 engine twice — with and without gathering — and
    report how far each merged model's outputs are from the adapted model's.

    Runs on every rank of a launched job (see ``__main__`` below); ZeRO-3 belongs in its own
    process because it changes how later modules are constructed in the process that used it.
    """
    import deepspeed

    from dschat_lib import config, models, runtime

    runtime.init_distributed()
    result = {}
    for gather in (True, False):
        model = models.build_causal_lm("cpu-tiny", vocab_size=vocab_size, seed=seed, num_hidden_layers=1,
                                       hidden_size=32, ffn_dim=64, num_attention_heads=2)
        model = apply_lora(model, LoraSettings(dim=rank))
        generator = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():   # B starts at 0; give the merge work to do
            if "lora_B" in name:
                param.data.normal_(std=0.5, generator=generator)
        tokens = torch.randint(0, vocab_size, (2, 8), generator=generator)
        with torch.no_grad():
            before = model(input_ids=tokens).logits
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=config.ds_config(stage=3, micro_batch_size=2, dtype="fp32", optimizer=config.adamw(1e-3)))
        local_numel = sum(p.numel() for p in engine.module.parameters())
        merged = merge(engine.module, zero_stage=3 if gather else 0)
        with torch.no_grad():
            after = merged(input_ids=tokens).logits      # ZeRO-3 hooks gather for the forward
        result["gathered" if gather else "not_gathered"] = {
            "max_abs_diff": (after - before).abs().max().item(), "local_numel_before_merge": local_numel}
        # Keep the process group: a launched rank cannot re-rendezvous on the launcher's port.
        engine.destroy()
    runtime.teardown()
    return result


if __name__ == "__main__":
    from dschat_lib import runtime

    outcome = zero3_merge_check()
    if runtime.RESULT_DIR_ENV in __import__("os").environ:
        runtime.write_rank_result(outcome)
    print(outcome)
