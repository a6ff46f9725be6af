import pytest
import torch

from dschat_lib import lora, models, runtime


def _model():
    return models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, num_hidden_layers=2,
                                  hidden_size=32, ffn_dim=64, num_attention_heads=2)


def _randomise_b(model):
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)


def test_targets_follow_module_name_and_skip_the_head():
    names = lora.target_linear_layers(_model(), "decoder.layers.")
    assert names and all("decoder.layers." in n for n in names)
    assert not any("lm_head" in n for n in lora.target_linear_layers(_model(), ""))
    with pytest.raises(ValueError, match="no linear layer"):
        lora.target_linear_layers(_model(), "encoder.")


def test_peft_layer_computes_the_formula():
    model = lora.apply_lora(_model(), lora.LoraSettings(dim=4, alpha=8))
    _randomise_b(model)
    layer = next(m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))
    assert layer.scaling["default"] == 2.0
    x = torch.randn(3, layer.base_layer.in_features)
    assert torch.allclose(layer(x), lora.lora_forward_by_hand(layer, x), atol=1e-6)


def test_training_starts_at_the_base_model():
    base = _model()
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = base(input_ids=x).logits
        after = lora.apply_lora(base, lora.LoraSettings(dim=4))(input_ids=x).logits
    assert torch.equal(before, after)   # B = 0 at initialisation


def test_trainable_counts_match_r_times_d_plus_k():
    base = _model()
    expected = sum(4 * (m.in_features + m.out_features) for n, m in base.named_modules()
                   if isinstance(m, torch.nn.Linear) and "decoder.layers." in n)
    total_before = models.parameter_count(base)
    model = lora.apply_lora(base, lora.LoraSettings(dim=4))
    trainable, total = lora.trainable_parameters(model)
    assert trainable == expected and total == total_before + expected


def test_lora_plus_full_finetuning_trains_everything():
    model = lora.apply_lora(_model(), lora.LoraSettings(dim=4, only_optimize_lora=False))
    trainable, total = lora.trainable_parameters(model)
    assert trainable == total


def test_parameter_groups_split_decay_and_lora_lr():
    model = lora.apply_lora(_model(), lora.LoraSettings(dim=4, only_optimize_lora=False))
    groups = {g["name"]: g for g in lora.parameter_groups(model, 1e-3, 0.1, lora_learning_rate=5e-3)}
    assert set(groups) == {"decay", "no_decay", "lora_decay"}
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.1
    assert groups["lora_decay"]["lr"] == 5e-3 and groups["decay"]["lr"] == 1e-3
    n_grouped = sum(p.numel() for g in groups.values() for p in g["params"])
    assert n_grouped == lora.trainable_parameters(model)[0]


def test_merge_keeps_outputs():
    model = lora.apply_lora(_model(), lora.LoraSettings(dim=4))
    _randomise_b(model)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = model(input_ids=x).logits
        merged = lora.merge(model)
        after = merged(input_ids=x).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (after - before).abs().max() < 1e-5


@pytest.mark.slow
def test_merge_under_zero3_needs_gathering(tmp_path):
    results = runtime.launch("dschat_lib.lora", num_ranks=2, result_dir=tmp_path)
    for result in results:
        assert result["gathered"]["max_abs_diff"] < 1e-5
        assert result["not_gathered"]["max_abs_diff"] > 1e-2     # the silent failure, measured
