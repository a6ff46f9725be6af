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
