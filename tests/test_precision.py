"""Float-format facts, the vanishing-update demonstration and loss-scale trace helpers."""

import math

import pytest
import torch

from dschat_lib import precision


def test_format_facts_match_ieee_and_bfloat16():
    facts = precision.format_facts()
    assert facts.loc["fp16", "largest finite"] == 65504
    assert facts.loc["fp16", "smallest subnormal"] == 2.0 ** -24
    assert facts.loc["fp16", "smallest normal"] == 2.0 ** -14
    assert facts.loc["bf16", "spacing near 1"] == 2.0 ** -7
    assert facts.loc["fp32", "spacing near 1"] == 2.0 ** -23
    assert facts.loc["bf16", "smallest normal"] == facts.loc["fp32", "smallest normal"]
    assert facts.loc["bf16", "smallest subnormal"] == 2.0 ** -133


def test_spacing_grows_with_magnitude():
    assert precision.spacing(1.0, torch.bfloat16) == 2.0 ** -7
    assert precision.spacing(2.0, torch.bfloat16) == 2.0 ** -6


def test_underflow_and_overflow_fractions():
    values = torch.tensor([1e-9, 1e-3, 1.0, 0.0])
    assert precision.underflow_fraction(values, torch.float16) == pytest.approx(1 / 3)
    assert precision.underflow_fraction(values, torch.float16, scale=2.0 ** 16) == 0
    assert precision.underflow_fraction(values, torch.bfloat16) == 0
    assert precision.overflow_fraction(values, torch.float16, scale=2.0 ** 20) == pytest.approx(1 / 4)


def test_small_updates_vanish_in_bf16_but_accumulate_in_the_fp32_master():
    trace = precision.repeated_update(1.0, 1e-3, 100, torch.bfloat16)
    assert trace["pure"][-1] == 1.0                       # every update rounded away
    assert trace["master"][-1] == pytest.approx(1.1, abs=1e-4)
    assert trace["master_rounded"][-1] == pytest.approx(1.1, abs=2.0 ** -7)


def test_lost_update_fraction_ignores_zero_updates():
    weights = torch.ones(4)
    updates = torch.tensor([1e-3, 1e-3, 0.0, 0.1])
    assert precision.lost_update_fraction(weights, updates, torch.bfloat16) == pytest.approx(2 / 3)
    assert precision.lost_update_fraction(weights, updates, torch.float32) == 0


HISTORY = [{"step": 0, "loss": 5.0, "loss_scale": 512.0, "skipped": 1},
           {"step": 1, "loss": 5.0, "loss_scale": 256.0, "skipped": 2},
           {"step": 2, "loss": 4.9, "loss_scale": 256.0, "skipped": 2},
           {"step": 3, "loss": 4.8, "loss_scale": 512.0, "skipped": 2}]


def test_loss_scale_helpers_read_a_trace():
    assert precision.skipped_steps(HISTORY) == [0, 1]
    assert precision.scale_ratio_after_first_overflow(HISTORY, initial_scale=1024.0) == 0.5
    changes = precision.scale_changes(HISTORY, 1024.0)
    assert [(c["step"], c["ratio"], c["skipped"]) for c in changes] == [(0, 0.5, True), (1, 0.5, True),
                                                                         (3, 2.0, False)]
    with pytest.raises(ValueError):
        precision.scale_ratio_after_first_overflow([{"step": 0, "loss_scale": 8.0, "skipped": 0}], 8.0)


def test_fp16_config_spells_out_every_key():
    block = precision.fp16_config(initial_scale_power=12, loss_scale_window=5, hysteresis=2)
    assert block == {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 5,
                     "hysteresis": 2, "min_loss_scale": 1}
    assert not math.isnan(block["loss_scale"])


def test_train_fp16_refuses_an_engine_without_a_loss_scale():
    class Bf16Engine:
        def fp16_enabled(self):
            return False

    with pytest.raises(ValueError, match="fp16 enabled"):
        precision.train_fp16(Bf16Engine(), iter([]), 1)
