"""Models: architectures and presets, create_hf_model, the reward model's reading of the last
real token, saving and loading in Hugging Face format (also under ZeRO-3), vocabulary checks."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dschat_lib import models, presets, tokenizer as tokenizer_lib

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)


@pytest.fixture(scope="module")
def tok():
    return tokenizer_lib.load_tokenizer()


def test_existing_api_still_works():
    model = models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, **SMALL)
    assert models.parameter_count(model) > 0
    assert models.architecture_config("llama-tiny", vocab_size=64).vocab_size == 64
    with pytest.raises(KeyError, match="unknown architecture"):
        models.architecture_config("opt-7b")


def test_cpu_tiny_with_the_shipped_tokenizer_is_about_a_million_parameters(tok):
    model = models.create_hf_model("cpu-tiny", tok, seed=0)
    assert 0.8e6 <= models.parameter_count(model) <= 5e6


@pytest.mark.parametrize("name, billions", [("opt-125m", 0.125), ("opt-350m", 0.331), ("opt-1.3b", 1.316)])
def test_gpu_architectures_match_the_public_checkpoints(name, billions):
    # Built on the meta device: shapes without memory, so a 1.3B model costs nothing here.
    with torch.device("meta"):
        model = models.create_hf_model(name)
    assert models.parameter_count(model) / 1e9 == pytest.approx(billions, rel=0.02)


def test_create_hf_model_sets_vocabulary_special_ids_and_dropout(tok):
    model = models.create_hf_model("cpu-tiny", tok, seed=0, dropout=0.0, **SMALL)
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert (model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id) == (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert model.config.dropout == 0.0 and model.config.attention_dropout == 0.0
    with_dropout = models.create_hf_model("cpu-tiny", tok, dropout=0.1, **SMALL)
    assert with_dropout.config.dropout == 0.1
    with pytest.raises(models.VocabularyMismatch, match="smaller than the tokenizer"):
        models.create_hf_model("cpu-tiny", tok, vocab_size=100, **SMALL)


def test_seeded_builds_repeat(tok):
    a = models.create_hf_model("cpu-tiny", tok, seed=3, **SMALL)
    b = models.create_hf_model("cpu-tiny", tok, seed=3, **SMALL)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_loading_a_base_checkpoint_resizes_to_a_bigger_tokenizer(tok, tmp_path):
    small = models.create_hf_model("cpu-tiny", vocab_size=300, seed=0, **SMALL)
    small.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="only apply to architectures"):
        models.create_hf_model(str(tmp_path), tok, hidden_size=64)
    resized = models.create_hf_model(str(tmp_path), tok)
    assert resized.get_input_embeddings().weight.shape[0] >= len(tok)
    # ...but a trained model is never resized silently.
    with pytest.raises(models.VocabularyMismatch, match=f"the tokenizer has {len(tok)} tokens"):
        models.load_hf_model(str(tmp_path), tok)


def _right_and_left_padded(tok, texts):
    ids = [tok(t)["input_ids"] + [tok.eos_token_id] for t in texts]
    length = max(map(len, ids)) + 2
    right = torch.full((len(ids), length), tok.pad_token_id)
    left = right.clone()
    for i, seq in enumerate(ids):
        right[i, :len(seq)] = torch.tensor(seq)
        left[i, length - len(seq):] = torch.tensor(seq)
    return right, (right != tok.pad_token_id).long(), left, (left != tok.pad_token_id).long()


@pytest.mark.parametrize("architecture, shape", [("cpu-tiny", SMALL),
                                                 ("llama-tiny", dict(hidden_size=32, num_hidden_layers=1,
                                                                     num_attention_heads=2, num_key_value_heads=1,
                                                                     intermediate_size=64))])
def test_reward_is_read_at_the_last_real_token_whatever_the_padding(tok, architecture, shape):
    reward_model = models.create_reward_model(architecture, tok, seed=0, **shape).eval()
    right, right_mask, left, left_mask = _right_and_left_padded(tok, ["\n\nHuman: Repeat this list: 1 2\n\nAssistant: 1 2",
                                                                  "\n\nHuman: Reverse this list: 5 6 7\n\nAssistant: 7 6 5"])
    with torch.no_grad():
        out_right = reward_model(right, attention_mask=right_mask)
        out_left = reward_model(left, attention_mask=left_mask)
        out_no_mask = reward_model(right)  # padding found from pad_token_id
    assert out_right["values"].shape == right.shape
    last = right_mask.sum(1) - 1
    assert torch.equal(out_right["rewards"], out_right["values"][torch.arange(2), last])
    assert torch.allclose(out_right["rewards"], out_left["rewards"], atol=1e-5)
    assert torch.equal(out_no_mask["rewards"], out_right["rewards"])
    with pytest.raises(ValueError, match="all padding"):
        reward_model(right, attention_mask=torch.zeros_like(right_mask))


def test_reward_model_has_gradients_into_head_and_backbone(tok):
    reward_model = models.create_reward_model("cpu-tiny", tok, seed=0, **SMALL)
    right, mask, _, _ = _right_and_left_padded(tok, ["\n\nHuman: Repeat this list: 1 2\n\nAssistant: 1 2"])
    reward_model(right, attention_mask=mask)["rewards"].sum().backward()
    assert reward_model.v_head.weight.grad.abs().sum() > 0
    assert reward_model.backbone.get_input_embeddings().weight.grad.abs().sum() > 0


def test_opt_350m_shaped_reward_head_matches_its_projection():
    with torch.device("meta"):
        reward_model = models.create_reward_model("opt-350m")
    assert reward_model.v_head.in_features == 512  # word_embed_proj_dim, not hidden_size 1024


def test_reward_model_save_and_load_round_trip(tok, tmp_path):
    from transformers import AutoModel

    reward_model = models.create_reward_model("cpu-tiny", tok, seed=0, **SMALL).eval()
    torch.nn.init.normal_(reward_model.v_head.weight)
    models.save_hf_model(reward_model, str(tmp_path), tokenizer=tok)
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / models.VALUE_HEAD_FILE).exists()
    loaded = models.load_reward_model(str(tmp_path), tok).eval()
    right, mask, _, _ = _right_and_left_padded(tok, ["\n\nHuman: Repeat this list: 1 2\n\nAssistant: 1 2"])
    with torch.no_grad():
        assert torch.allclose(loaded(right, attention_mask=mask)["rewards"],
                              reward_model(right, attention_mask=mask)["rewards"])
    assert isinstance(AutoModel.from_pretrained(str(tmp_path)), torch.nn.Module)  # plain HF format
    assert tokenizer_lib.load_tokenizer(tmp_path).pad_token_id == tok.pad_token_id
    with pytest.raises(FileNotFoundError, match="is not a saved RewardModel"):
        models.load_reward_model(str(tmp_path / "nowhere"))
    bigger = tokenizer_lib.train_tokenizer(["x"], vocab_size=300)
    bigger.add_tokens([f"<extra{i}>" for i in range(len(tok))])
    with pytest.raises(models.VocabularyMismatch):
        models.load_reward_model(str(tmp_path), bigger)


def test_causal_lm_save_and_load_round_trip(tok, tmp_path):
    model = models.create_hf_model("cpu-tiny", tok, seed=0, **SMALL).eval()
    models.save_hf_model(model, str(tmp_path), tokenizer=tok)
    assert (tmp_path / "model.safetensors").exists()
    loaded = models.load_hf_model(str(tmp_path), tok).eval()
    ids = tok("\n\nHuman: Repeat this list: 1 2\n\nAssistant:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)


ZERO3_SAVE = textwrap.dedent("""
    import sys, torch, deepspeed
    from dschat_lib import config, models, runtime, tokenizer as tokenizer_lib
    tok = tokenizer_lib.load_tokenizer()
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64)
    runtime.init_distributed()
    for kind, build in (("causal-lm", models.create_hf_model), ("reward", models.create_reward_model)):
        model = build("cpu-tiny", tok, seed=0, **small)
        cfg = config.ds_config(stage=3, micro_batch_size=1, dtype="fp32", optimizer=config.adamw(1e-3))
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        local = sum(p.numel() for p in engine.module.parameters())
        assert local == 0, f"ZeRO-3 should leave no full parameters locally, found {local}"
        models.save_hf_model(engine, f"{sys.argv[1]}/{kind}", tokenizer=tok)
        engine.destroy()
    runtime.teardown()
""")


@pytest.mark.slow
def test_save_under_zero3_gathers_the_full_weights(tok, tmp_path):
    # In a subprocess: once a ZeRO-3 engine existed, later work in the same process runs slower.
    proc = subprocess.run([sys.executable, "-c", ZERO3_SAVE, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = [(models.create_hf_model("cpu-tiny", tok, seed=0, **SMALL),
              models.load_hf_model(str(tmp_path / "causal-lm"), tok)),
             (models.create_reward_model("cpu-tiny", tok, seed=0, **SMALL),
              models.load_reward_model(str(tmp_path / "reward"), tok))]
    for reference, loaded in pairs:
        expected = dict(reference.named_parameters())
        assert set(dict(loaded.named_parameters())) == set(expected)
        for name, param in loaded.named_parameters():
            assert torch.equal(param, expected[name]), name


# --------------------------------------------------------------------------- presets

def test_presets_name_models_by_architecture_or_hub_id():
    for preset in presets.PRESETS.values():
        for model in (preset.actor_model, preset.reward_model):
            assert model in models.ARCHITECTURES or "/" in model, (preset.name, model)
        assert preset.max_prompt_len + preset.max_answer_len <= max(preset.max_seq_len, 512)
    default = presets.get_preset()
    assert default.name == "cpu-tiny" and default.actor_is_architecture and default.dtype == "bf16"
    gpu = presets.get_preset("opt-1.3b")
    assert gpu.data == ("Dahoas/rm-static",) and gpu.max_seq_len == 512 and not gpu.actor_is_architecture
    assert presets.get_preset("opt-125m").reward_model == "opt-350m"


def test_preset_overrides_and_errors():
    preset = presets.get_preset("opt-125m", data="shipped", tokenizer="shipped", max_seq_len=64)
    assert preset.data == ("shipped",) and preset.max_seq_len == 64
    with pytest.raises(KeyError, match="unknown preset"):
        presets.get_preset("gpt-5")
    with pytest.raises(TypeError, match="no field"):
        presets.get_preset("cpu-tiny", learning_rate=1.0)


@pytest.mark.parametrize("architecture, shape", [("cpu-tiny", SMALL),
                                                 ("llama-tiny", dict(hidden_size=32, num_hidden_layers=1,
                                                                     num_attention_heads=2, num_key_value_heads=1,
                                                                     intermediate_size=64))])
def test_reward_model_from_an_sft_checkpoint_keeps_its_weights(tok, tmp_path, architecture, shape):
    # Step 2 starts from the step-1 model: the backbone must come out of the causal-LM checkpoint
    # with its trained weights, not be silently re-initialised.
    sft = models.create_hf_model(architecture, tok, seed=5, **shape)
    models.save_hf_model(sft, str(tmp_path), tokenizer=tok)
    reward_model = models.create_reward_model(str(tmp_path), tok, seed=0)
    backbone = dict(reward_model.backbone.named_parameters())
    for name, param in sft.base_model.named_parameters():
        assert torch.equal(backbone[name], param), name
