"""Models: named architectures built from config (random init) or loaded from a checkpoint.

Nothing here downloads anything unless you pass a Hub id: the book's runs build models from
the architecture tables below, which copy the shapes of the public checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, OPTConfig, PretrainedConfig

#: Architectures by name. Shapes of the public OPT checkpoints (Zhang et al. 2022, table 1)
#: and a small Llama-style decoder; ``cpu-tiny`` is the book's default on a 2-core CPU.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "cpu-tiny": dict(family="opt", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                     ffn_dim=512, max_position_embeddings=256),
    "opt-125m": dict(family="opt", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     ffn_dim=3072, max_position_embeddings=2048),
    "opt-350m": dict(family="opt", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                     ffn_dim=4096, max_position_embeddings=2048, word_embed_proj_dim=512,
                     do_layer_norm_before=False),
    "opt-1.3b": dict(family="opt", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                     ffn_dim=8192, max_position_embeddings=2048),
    "llama-tiny": dict(family="llama", hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, intermediate_size=344, max_position_embeddings=256),
}

#: Vocabulary of the public OPT tokenizer, used when no tokenizer is given.
OPT_VOCAB_SIZE = 50272


def architecture_config(name: str, vocab_size: int = OPT_VOCAB_SIZE, dropout: float = 0.0,
                        **overrides: Any) -> PretrainedConfig:
    """The transformers config for a named architecture with the given vocabulary size."""
    if name not in ARCHITECTURES:
        raise KeyError(f"unknown architecture {name!r}; known: {sorted(ARCHITECTURES)}")
    spec = {**ARCHITECTURES[name], **overrides}
    family = spec.pop("family")
    if family == "opt":
        spec.setdefault("word_embed_proj_dim", spec["hidden_size"])
        return OPTConfig(vocab_size=vocab_size, dropout=dropout, attention_dropout=dropout, **spec)
    return LlamaConfig(vocab_size=vocab_size, attention_dropout=dropout, **spec)


def build_causal_lm(name: str, vocab_size: int = OPT_VOCAB_SIZE, seed: int | None = None,
                    dtype: torch.dtype = torch.float32, **overrides: Any) -> torch.nn.Module:
    """A randomly initialised causal LM of a named architecture."""
    if seed is not None:
        torch.manual_seed(seed)
    config = architecture_config(name, vocab_size=vocab_size, **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------- the RLHF models
# Step 1 and step 3's actor are causal LMs (create_hf_model); step 2's reward model and step
# 3's critic are a backbone with a scalar head (RewardModel). Both are saved in Hugging Face
# format with safetensors, so a saved model loads with plain transformers as well as here.

#: Config attributes that hold a dropout probability, across the model families we build.
DROPOUT_ATTRIBUTES = ("dropout", "attention_dropout", "activation_dropout", "hidden_dropout",
                      "hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                      "embd_pdrop", "attn_pdrop")
#: The value head's own file beside the backbone's model.safetensors.
VALUE_HEAD_FILE = "value_head.safetensors"
#: Marks a directory as a saved RewardModel and records how it reads rewards.
REWARD_CONFIG_FILE = "reward_model.json"


class VocabularyMismatch(ValueError):
    """The tokenizer has ids the model's embedding table has no row for (or the reverse)."""


def set_dropout(config: PretrainedConfig, dropout: float | None) -> PretrainedConfig:
    """Set every dropout probability the config has to ``dropout`` (None leaves them as they are).

    RLHF usually trains with dropout off (DeepSpeed-Chat's ``--disable_dropout``): in PPO the
    log-probabilities of the same tokens are compared across two forward passes, and dropout
    noise would show up as a policy change.
    """
    if dropout is not None:
        for name in DROPOUT_ATTRIBUTES:
            if hasattr(config, name):
                setattr(config, name, dropout)
    return config


def check_vocabulary(model: torch.nn.Module, tokenizer, source: str = "model") -> None:
    """Raise :class:`VocabularyMismatch` if some token id has no embedding row.

    A model may have *more* rows than the tokenizer has tokens (OPT pads its table to a multiple
    of 8); fewer rows means some ids index past the table — an error on CPU, garbage on some GPUs.
    """
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise VocabularyMismatch(
            f"{source}: the tokenizer has {len(tokenizer)} tokens but the model's embedding table "
            f"has {rows} rows; pass the tokenizer the model was trained with, or build the model "
            "with create_hf_model(..., tokenizer=tokenizer), which resizes a base model's table")


def _set_special_ids(config: PretrainedConfig, tokenizer) -> None:
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id


def create_hf_model(name_or_path: str, tokenizer=None, *, vocab_size: int | None = None,
                    dropout: float | None = 0.0, seed: int | None = None,
                    dtype: torch.dtype = torch.float32, head: str = "causal-lm",
                    **overrides: Any) -> torch.nn.Module:
    """A transformers model, either built from a named architecture or loaded from a checkpoint.

    ``name_or_path``: a key of :data:`ARCHITECTURES` (random init, ``overrides`` change its
    shape), or a local directory / Hub id (weights loaded; ``overrides`` are not allowed).
    ``tokenizer``: sets the vocabulary size of a built model, and the model's pad/BOS/EOS ids;
    a loaded model whose embedding table is smaller than the tokenizer is resized to it
    (the new rows start at the mean embedding). ``vocab_size`` is for building without a
    tokenizer. ``dropout``: every dropout probability in the config (None keeps the config's).
    ``head``: ``"causal-lm"`` (LM head; the actor) or ``"none"`` (the bare backbone; what
    :class:`RewardModel` wraps).
    """
    from transformers import AutoModel

    if head not in ("causal-lm", "none"):
        raise ValueError(f"head must be 'causal-lm' or 'none', not {head!r}")
    auto = AutoModelForCausalLM if head == "causal-lm" else AutoModel
    if seed is not None:
        torch.manual_seed(seed)
    if name_or_path in ARCHITECTURES:
        if tokenizer is not None and vocab_size is not None and vocab_size < len(tokenizer):
            raise VocabularyMismatch(f"vocab_size={vocab_size} is smaller than the tokenizer "
                                     f"({len(tokenizer)} tokens)")
        size = vocab_size or (len(tokenizer) if tokenizer is not None else OPT_VOCAB_SIZE)
        config = architecture_config(name_or_path, vocab_size=size, **overrides)
        set_dropout(config, dropout)
        if tokenizer is not None:
            _set_special_ids(config, tokenizer)
        model = auto.from_config(config, dtype=dtype)
    else:
        if overrides:
            raise ValueError(f"shape overrides {sorted(overrides)} only apply to architectures "
                             f"built from config, not to the checkpoint {name_or_path!r}")
        config = set_dropout(AutoConfig.from_pretrained(name_or_path), dropout)
        if tokenizer is not None:
            _set_special_ids(config, tokenizer)
        model = auto.from_pretrained(name_or_path, config=config, dtype=dtype)
        if tokenizer is not None and len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
            model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=8)
    if tokenizer is not None:
        check_vocabulary(model, tokenizer, source=str(name_or_path))
    return model


def load_hf_model(path: str, tokenizer=None, dtype: torch.dtype = torch.float32,
                  dropout: float | None = 0.0) -> torch.nn.Module:
    """A trained causal LM saved by :func:`save_hf_model`. Unlike :func:`create_hf_model` it never
    resizes: a trained model and a different tokenizer is a mistake, and it says so."""
    config = set_dropout(AutoConfig.from_pretrained(path), dropout)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    if tokenizer is not None:
        check_vocabulary(model, tokenizer, source=str(path))
    return model


class RewardModel(torch.nn.Module):
    """A transformer backbone with a scalar value head: one number per token.

    ``forward(input_ids, attention_mask)`` returns a dict with
    - ``values`` (batch, seq): the head's output at every position — step 3's critic uses these
      as per-token value estimates;
    - ``rewards`` (batch,): the value at the **last non-pad token** of each sequence (the EOS
      ending the response) — step 2's reward.

    Which token is "last" comes from ``attention_mask``, so left and right padding both work,
    and no count of leading pad tokens has to be guessed (DeepSpeed-Chat's reward model takes
    ``num_padding_at_beginning`` as an argument because OPT's BOS and pad tokens get confused).
    Without a mask, padding is found from ``pad_token_id``, which must then differ from EOS.
    Position ids count from each sequence's first real token unless given.
    """

    def __init__(self, backbone: torch.nn.Module, pad_token_id: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.pad_token_id = self.config.pad_token_id if pad_token_id is None else pad_token_id
        # OPT projects its last hidden state down to word_embed_proj_dim (opt-350m: 1024 -> 512).
        width = getattr(self.config, "word_embed_proj_dim", None) or self.config.hidden_size
        self.v_head = torch.nn.Linear(width, 1, bias=False,
                                      dtype=next(backbone.parameters()).dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        if attention_mask is None:
            if self.pad_token_id is None:
                raise ValueError("RewardModel needs an attention_mask or a pad_token_id to find "
                                 "the last real token of each sequence")
            attention_mask = (input_ids != self.pad_token_id).long()
        if "position_ids" not in kwargs:
            # Count positions from each sequence's first real token, so a left-padded sequence
            # gets the same positions (and the same reward) as a right-padded one. OPT derives
            # them from the mask itself; Llama would otherwise number the padding too.
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               **kwargs).last_hidden_state
        values = self.v_head(hidden).squeeze(-1)
        return {"values": values, "rewards": values.gather(1, last_token_index(attention_mask)).squeeze(1)}

    def gradient_checkpointing_enable(self, **kwargs: Any) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(batch, 1) position of the last 1 in each row of the mask, for any padding side."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * positions).argmax(dim=1, keepdim=True)
    if not bool(attention_mask.any(dim=1).all()):
        raise ValueError("a sequence in the batch is all padding (its attention_mask is all zeros)")
    return last


def create_reward_model(name_or_path: str, tokenizer=None, **kwargs: Any) -> RewardModel:
    """A :class:`RewardModel` on a backbone from :func:`create_hf_model` (same arguments).

    From a causal-LM checkpoint (e.g. the SFT model), the backbone weights are loaded and the
    LM head is dropped; the value head starts from a seeded random init.
    """
    backbone = create_hf_model(name_or_path, tokenizer, head="none", **kwargs)
    return RewardModel(backbone)


# --------------------------------------------------------------------------- saving and loading

def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a DeepSpeed engine (or the model itself)."""
    return getattr(model, "module", model)


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full state dict on CPU — on rank 0; ``None`` on other ranks under ZeRO-3.

    Under ZeRO-3 each rank holds only a shard of every parameter (a parameter's local tensor is
    empty), so the full weights must be gathered before saving — one parameter at a time, to
    keep the peak memory at one parameter rather than the whole model. Shared (tied) weights
    appear once, under their first name, as ``named_parameters`` lists them.
    """
    model = _unwrap(model)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    partitioned = any(hasattr(p, "ds_id") for p in model.parameters())
    state: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if partitioned:
            import deepspeed
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if rank == 0:
                    state[name] = param.detach().cpu().clone()
        elif rank == 0:
            state[name] = param.detach().cpu().clone()
    for name, buffer in model.named_buffers():
        if rank == 0:
            state[name] = buffer.detach().cpu().clone()
    return state if rank == 0 else None


def save_hf_model(model: torch.nn.Module, out_dir: str, tokenizer=None) -> str | None:
    """Save a causal LM or a :class:`RewardModel` in Hugging Face format with safetensors.

    Works for a plain module or a DeepSpeed engine at any ZeRO stage (call it on every rank;
    rank 0 writes). A RewardModel is saved as its backbone (``config.json`` +
    ``model.safetensors``, loadable with ``AutoModel``) plus ``value_head.safetensors`` and
    ``reward_model.json``; :func:`load_reward_model` reads them back.
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    module = _unwrap(model)
    state = gathered_state_dict(module)
    if state is None:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(module, RewardModel):
        backbone_state = {k[len("backbone."):]: v for k, v in state.items() if k.startswith("backbone.")}
        module.backbone.save_pretrained(str(out), state_dict=backbone_state)
        save_file({"weight": state["v_head.weight"].contiguous()}, str(out / VALUE_HEAD_FILE))
        (out / REWARD_CONFIG_FILE).write_text(json.dumps(
            {"pad_token_id": module.pad_token_id, "reward": "value at the last non-pad token"}, indent=1))
    else:
        module.save_pretrained(str(out), state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return str(out)


def load_reward_model(path: str, tokenizer=None, dtype: torch.dtype = torch.float32,
                      dropout: float | None = 0.0) -> RewardModel:
    """A RewardModel saved by :func:`save_hf_model` — step 3 loads it as its reward model and as
    the starting point of its critic. Checks the tokenizer against the embedding table."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModel

    path = Path(path)
    if not (path / REWARD_CONFIG_FILE).exists() or not (path / VALUE_HEAD_FILE).exists():
        raise FileNotFoundError(f"{path} is not a saved RewardModel: {REWARD_CONFIG_FILE} or "
                                f"{VALUE_HEAD_FILE} is missing (save it with models.save_hf_model)")
    config = set_dropout(AutoConfig.from_pretrained(str(path)), dropout)
    backbone = AutoModel.from_pretrained(str(path), config=config, dtype=dtype)
    meta = json.loads((path / REWARD_CONFIG_FILE).read_text())
    model = RewardModel(backbone, pad_token_id=meta["pad_token_id"])
    model.v_head.weight.data.copy_(load_file(str(path / VALUE_HEAD_FILE))["weight"].to(dtype))
    if tokenizer is not None:
        check_vocabulary(backbone, tokenizer, source=str(path))
    return model
