"""Where training memory goes: formulas, DeepSpeed's own estimators, and measured tensors.

Three views of the same question, kept side by side so each checks the others:

1. **Formulas** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
   Parameter Models", section 3.1 and figure 1): mixed-precision Adam keeps 2 bytes of 16-bit
   parameters, 2 bytes of 16-bit gradients and K = 12 bytes of optimizer state (fp32 master
   copy, momentum, variance) per parameter; ZeRO stage 1/2/3 divides the optimizer state /
   plus gradients / plus parameters by the number of data-parallel ranks N_d.
2. **DeepSpeed's estimators** (``estimate_zero2_model_states_mem_needs``,
   ``estimate_zero3_model_states_mem_needs``), which count the implementation's buffers.
3. **Measurement**: :func:`engine_state_bytes` reads the tensors a live engine holds, by
   category, on this rank.

Activation memory follows Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1, and is measured with autograd's saved-tensor hooks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable

import torch

#: The ZeRO paper and GPU vendors quote decimal gigabytes.
GB = 1e9

#: Bytes per parameter of each model-state component, by training precision.
#: "mixed" is fp16/bf16 compute with an fp32 master copy (the ZeRO paper's K = 12 = 4 + 4 + 4).
#: "fp32" keeps everything in fp32 and needs no separate master copy.
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "mixed": {"params_16bit": 2, "grads_16bit": 2, "fp32_master": 4, "adam_momentum": 4,
              "adam_variance": 4},
    "fp32": {"params_fp32": 4, "grads_fp32": 4, "adam_momentum": 4, "adam_variance": 4},
}
#: Extra bytes when gradients are accumulated in fp32 (e.g. bf16 with
#: ``data_types.grad_accum_dtype = "fp32"``): a 4-byte gradient buffer on top of the 16-bit one.
FP32_GRAD_ACCUM_BYTES = 4

#: Which components each ZeRO stage partitions across data-parallel ranks (paper, section 5).
PARTITIONED: dict[int, frozenset[str]] = {
    0: frozenset(),
    1: frozenset({"fp32_master", "adam_momentum", "adam_variance"}),
    2: frozenset({"fp32_master", "adam_momentum", "adam_variance", "grads_16bit", "grads_fp32_accum"}),
    3: frozenset({"fp32_master", "adam_momentum", "adam_variance", "grads_16bit", "grads_fp32_accum",
                  "params_16bit"}),
}

#: The ZeRO paper's worked example (figure 1): a 7.5B-parameter model on 64 GPUs.
ZERO_PAPER_PARAMS = 7.5e9
ZERO_PAPER_GPUS = 64

#: Nominal model sizes for the pictures; the formulas are per parameter, so round numbers do.
MODEL_SIZES: dict[str, float] = {"125M": 125e6, "350M": 350e6, "1.3B": 1.3e9, "7B": 7e9,
                                 "13B": 13e9, "70B": 70e9}

#: Measured engine memory is grouped into these categories (the formula's components, with
#: the two Adam moments together).
CATEGORIES = ("params_16bit", "grads", "fp32_master", "adam_moments")


# --------------------------------------------------------------------------- formulas

def bytes_per_param(precision: str = "mixed", grad_accum_fp32: bool = False) -> dict[str, int]:
    """Bytes per parameter of each model-state component (no partitioning).

    ``bytes_per_param()`` sums to 16 (2 + 2 + 12); with ``grad_accum_fp32=True`` to 20.
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(BYTES_PER_PARAM)}, got {precision!r}")
    components = dict(BYTES_PER_PARAM[precision])
    if grad_accum_fp32:
        if precision != "mixed":
            raise ValueError("fp32 gradient accumulation only adds memory in mixed precision")
        components["grads_fp32_accum"] = FP32_GRAD_ACCUM_BYTES
    return components


def model_states_bytes(num_params: float, stage: int = 0, dp_ranks: int = 1,
                       precision: str = "mixed", grad_accum_fp32: bool = False) -> dict[str, float]:
    """Bytes of each model-state component held by one data-parallel rank under ZeRO ``stage``."""
    if stage not in PARTITIONED:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp_ranks < 1:
        raise ValueError(f"dp_ranks must be >= 1, got {dp_ranks!r}")
    # In fp32 training the "16-bit" roles are played by fp32 tensors; partition them alike.
    aliases = {"params_fp32": "params_16bit", "grads_fp32": "grads_16bit"}
    out = {}
    for name, nbytes in bytes_per_param(precision, grad_accum_fp32).items():
        divisor = dp_ranks if aliases.get(name, name) in PARTITIONED[stage] else 1
        out[name] = num_params * nbytes / divisor
    return out


def model_states_total(num_params: float, stage: int = 0, dp_ranks: int = 1, **kwargs: Any) -> float:
    return sum(model_states_bytes(num_params, stage, dp_ranks, **kwargs).values())


def zero_paper_example() -> dict[int, float]:
    """Per-GPU model states in GB for the paper's 7.5B model on 64 GPUs, stages 0–3
    (the paper's figure 1: 120, 31.4, 16.6 and 1.9 GB)."""
    return {stage: model_states_total(ZERO_PAPER_PARAMS, stage, ZERO_PAPER_GPUS) / GB
            for stage in PARTITIONED}


def grouped(components: dict[str, float]) -> dict[str, float]:
    """Formula components in the measured categories (momentum + variance = adam_moments)."""
    out = {c: 0.0 for c in CATEGORIES}
    for name, value in components.items():
        key = {"adam_momentum": "adam_moments", "adam_variance": "adam_moments",
               "grads_16bit": "grads", "grads_fp32_accum": "grads", "grads_fp32": "grads",
               "params_fp32": "params_16bit"}.get(name, name)
        out[key] += value
    return out


# --------------------------------------------------------------------------- parameter count

def parameter_count_from_config(config: Any) -> int:
    """Parameters of an OPT or Llama causal LM, from its transformers config alone.

    Counted layer by layer (weights and biases) so the arithmetic can be read against the
    architecture; checked in the tests against ``numel`` of a real model.
    """
    d, V, L = config.hidden_size, config.vocab_size, config.num_hidden_layers
    if config.model_type == "opt":
        f, p = config.ffn_dim, config.word_embed_proj_dim
        embeddings = V * p + (config.max_position_embeddings + 2) * d  # OPT offsets positions by 2
        projections = 2 * p * d if p != d else 0                       # project_in / project_out
        attention = 4 * (d * d + d)                                    # q, k, v, out with biases
        mlp = d * f + f + f * d + d                                    # fc1, fc2 with biases
        layer_norms = 2 * 2 * d                                        # weight + bias, twice
        final_norm = 2 * d if (config.do_layer_norm_before and not config._remove_final_layer_norm) else 0
        lm_head = 0 if config.tie_word_embeddings else V * p
        return embeddings + projections + L * (attention + mlp + layer_norms) + final_norm + lm_head
    if config.model_type == "llama":
        head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
        kv = config.num_key_value_heads * head_dim
        bias = 1 if config.attention_bias else 0
        attention = d * d + 2 * d * kv + d * d + bias * (d + 2 * kv + d)
        i = config.intermediate_size
        mlp = 3 * d * i + (2 * i + d if getattr(config, "mlp_bias", False) else 0)  # gate, up, down
        norms = 2 * d                                                  # RMSNorm weights only
        lm_head = 0 if config.tie_word_embeddings else V * d
        return V * d + L * (attention + mlp + norms) + d + lm_head
    raise NotImplementedError(f"no parameter formula for model_type {config.model_type!r}")


def largest_layer_params(model: torch.nn.Module) -> int:
    """Parameters of the largest single submodule that owns parameters directly (what ZeRO-3
    must gather at once; DeepSpeed's ZeRO-3 estimator needs it)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


# --------------------------------------------------------------------------- DeepSpeed's estimators

def deepspeed_estimates(num_params: int, largest_layer: int, dp_ranks: int) -> dict[str, float]:
    """Per-GPU bytes from DeepSpeed's own estimators (no offload, one node of ``dp_ranks``)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, zero2 = estimate_zero2_model_states_mem_needs(num_params, num_gpus_per_node=dp_ranks,
                                                     cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(num_params, largest_layer,
                                                     num_gpus_per_node=dp_ranks, cpu_offload=False,
                                                     cpu_offload_params=False)
    return {"zero2": float(zero2), "zero3": float(zero3)}


# --------------------------------------------------------------------------- does it fit

def fit_table(gpu_memory_gb: float, num_gpus: int, sizes: dict[str, float] | None = None,
              headroom: float = 0.8) -> "Any":
    """Does each model's model state fit per GPU, per ZeRO stage? A DataFrame of GB per GPU
    with a ✓ where it fits in ``headroom`` × the GPU's memory (the rest is left for
    activations, buffers and fragmentation — a rule of thumb, not a guarantee)."""
    import pandas as pd

    sizes = sizes or MODEL_SIZES
    rows = {}
    for name, n in sizes.items():
        cells = {}
        for stage in PARTITIONED:
            gb = model_states_total(n, stage, num_gpus) / GB
            cells[f"ZeRO-{stage}"] = f"{gb:,.1f} {'✓' if gb <= headroom * gpu_memory_gb else '✗'}"
        rows[name] = cells
    return pd.DataFrame.from_dict(rows, orient="index")


# --------------------------------------------------------------------------- measured engine state

def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a view that shares another's memory is counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen or t.numel() == 0:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def _flat(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat(v)]
    return []


def local_parameter_numel(module: torch.nn.Module) -> int:
    """Parameter elements stored on this rank: the ZeRO-3 partition (``p.ds_tensor``) where
    parameters are partitioned, the full tensor otherwise. Tied weights count once."""
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = getattr(p, "ds_tensor", None)
        total += (local.ds_numel if hasattr(local, "ds_numel") else local.numel()) if local is not None \
            else p.numel()
    return total


#: Where each DeepSpeed optimizer wrapper keeps the categories (attribute names, DeepSpeed 0.19).
#: Read between ``engine.backward`` and ``engine.step``, when a rank holds its gradients.
_WRAPPER_ATTRIBUTES = {
    # ZeRO-0 with fp16/bf16: flat 16-bit and fp32 copies of all parameters; grads in p.grad.
    "FP16_Optimizer": {"params_16bit": "fp16_groups_flat", "fp32_master": "fp32_groups_flat"},
    # ZeRO-1/2: full flat 16-bit params; this rank's partition of fp32 master and gradients.
    "DeepSpeedZeroOptimizer": {"params_16bit": "bit16_groups_flat", "grads": "averaged_gradients",
                               "fp32_master": "single_partition_of_fp32_groups"},
    # ZeRO-3: every category is a partition.
    "DeepSpeedZeroOptimizer_Stage3": {"params_16bit": "fp16_partitioned_groups_flat",
                                      "grads": "grad_partitions_flat_buffer",
                                      "fp32_master": "fp32_partitioned_groups_flat"},
}


def engine_state_bytes(engine: Any) -> dict[str, int]:
    """Bytes of model state this rank holds right now, by category (see :data:`CATEGORIES`;
    "params_16bit" holds the module's parameters whatever their dtype).

    Call it between ``engine.backward(loss)`` and ``engine.step()``, the moment a rank holds
    parameters, gradients and optimizer state together. Tensors swapped out to NVMe hold no
    memory and count as zero here (see the offload chapter for the bytes on disk).
    """
    optimizer = engine.optimizer
    wrapper = type(optimizer).__name__
    attributes = _WRAPPER_ATTRIBUTES.get(wrapper, {})
    out = {}
    for category in ("params_16bit", "grads", "fp32_master"):
        attribute = attributes.get(category)
        out[category] = _nbytes(_flat(getattr(optimizer, attribute, None))) if attribute else 0
    if "grads" not in attributes:                  # ZeRO-0: gradients live on the parameters
        out["grads"] = _nbytes(p.grad for p in engine.module.parameters())
    # With the optimizer offloaded, ZeRO accumulates gradients straight into fp32 buffers
    # attached to the master partition (the 16-bit gradient partition may then be empty).
    master = _flat(getattr(optimizer, attributes.get("fp32_master", ""), None))
    out["grads"] += _nbytes(t.grad for t in master if t.grad is not None)
    if wrapper not in _WRAPPER_ATTRIBUTES:         # plain fp32 training: the module is everything
        out["params_16bit"] = _nbytes(engine.module.parameters())
    basic = getattr(engine, "basic_optimizer", None) or optimizer
    out["adam_moments"] = _nbytes(t for state in basic.state.values() for k, t in state.items()
                                  if k in ("exp_avg", "exp_avg_sq"))
    return out


# --------------------------------------------------------------------------- activations

def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int,
                               checkpointing: bool = False, dropout: bool = True) -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit, no tensor parallelism.

    Korthikanti et al. 2022, section 4.1: ``s·b·h·(34 + 5·a·s/h)`` with dropout and the
    attention matrix stored. Their breakdown (attention 11·sbh + 5·as²b, MLP 19·sbh, layer
    norms 4·sbh) includes three dropout masks and a dropout output; without dropout
    (``dropout=False``, as in the book's models) those go: ``s·b·h·(32 + 2·a·s/h)``.
    With full activation checkpointing only the layer's input is kept, ``2·s·b·h`` (and one
    layer's activations are rebuilt at a time during backward).
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    if checkpointing:
        return 2.0 * s * b * h
    if dropout:
        return s * b * h * (34 + 5 * a * s / h)
    return s * b * h * (32 + 2 * a * s / h)


def hf_opt_eager_activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int,
                                            heads: int) -> float:
    """The no-dropout formula adjusted to what Hugging Face's OPT layer with eager attention
    actually saves, in 16-bit: ``s·b·h·(24 + 6·a·s/h)``.

    Two implementation details move the terms: the ReLU's output is also the second MLP
    matmul's input, so the 8·sbh it would add is shared (32 → 24); and the softmax runs in
    fp32, so the attention probabilities are saved twice, 4 bytes for the softmax and 2 for the
    matmul with V (2·as²b → 6·as²b).
    """
    s, b, h, a = seq_len, micro_batch, hidden, heads
    return s * b * h * (24 + 6 * a * s / h)


@contextlib.contextmanager
def _counting_saved_tensors(model: torch.nn.Module, layers: list[torch.nn.Module],
                            counts: dict[str, Any]):
    """Count bytes autograd saves for backward, split into 'layers' and 'other'.

    Distinct storages are counted once (autograd often saves the same tensor for two ops);
    storages of parameters are skipped (a linear layer saves its weight, or a view of it)."""
    state = {"inside": 0}
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def enter(*_):
        state["inside"] += 1

    def leave(*_):
        state["inside"] -= 1

    def pack(t):
        key = t.untyped_storage().data_ptr()
        where = "layers" if state["inside"] else "other"
        if key not in counts["_seen"] and key not in parameter_storages:
            counts["_seen"].add(key)
            counts[where] += t.untyped_storage().nbytes()
        return t

    handles = [h for layer in layers for h in (layer.register_forward_pre_hook(enter),
                                               layer.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
    finally:
        for h in handles:
            h.remove()


def measure_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                             layers: list[torch.nn.Module]) -> dict[str, int]:
    """Bytes of activations saved for backward by one forward pass, inside the decoder
    ``layers`` and elsewhere (embeddings, final norm, logits and loss).

    Parameters are excluded: they are model state, not activations. Checkpointing, if the model has
    it enabled, shows up as fewer saved bytes: the checkpointed layers save only their inputs.
    """
    counts: dict[str, Any] = {"layers": 0, "other": 0, "_seen": set()}
    with _counting_saved_tensors(model, layers, counts):
        loss = model(**batch).loss
    loss.backward()        # use the graph once, so the measurement leaves nothing behind
    model.zero_grad(set_to_none=True)
    return {"layers": counts["layers"], "other": counts["other"]}


# --------------------------------------------------------------------------- side by side

def per_stage_breakdown(num_params: float, dp_ranks: int, **kwargs: Any) -> dict[int, dict[str, float]]:
    """``{stage: {category: bytes per rank}}`` from the formulas, for the pictures."""
    return {stage: grouped(model_states_bytes(num_params, stage, dp_ranks, **kwargs))
            for stage in PARTITIONED}


def expected_measured_over_formula(stage: int, dp_ranks: int) -> float:
    """What measured/formula should be for DeepSpeed's ZeRO-1, and 1 elsewhere.

    The paper's stage 1 (P_os) keeps full gradients; DeepSpeed's ZeRO-1 reduce-scatters them
    at the end of backward and keeps only its own partition until the step, exactly like
    ZeRO-2 at that moment (ZeRO-2 differs by doing it bucket by bucket *during* backward,
    which lowers the peak). So between backward and step DeepSpeed's ZeRO-1 holds the ZeRO-2
    amount of memory.
    """
    if stage != 1:
        return 1.0
    return model_states_total(1.0, 2, dp_ranks) / model_states_total(1.0, 1, dp_ranks)
