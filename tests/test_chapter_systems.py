"""The claims the systems chapters (memory, ZeRO, mixed precision) make, read from the values
their notebooks glued. Each assertion names the sentence of the prose it backs."""

import math

import pytest

from dschat_lib import memory

pytestmark = pytest.mark.notebook

#: Measured/formula may differ by DeepSpeed's alignment padding of flat partitions: a few
#: elements per rank, far below 1 % for any model the book measures.
MEASURED_OVER_FORMULA_TOLERANCE = 0.01


def test_memory_formulas(glue):
    values = glue("01-memory")
    assert values["mem_param_formula_max_abs_error"] == 0
    assert values["mem_bytes_per_param_mixed"] == 16
    assert values["mem_bytes_per_param_fp32_accum"] == 20
    assert values["mem_7b_mixed_adam_gb"] == 112
    assert values["mem_7b_fp32_accum_gb"] == 140
    assert [values[f"zero_paper_gb_stage{s}"] for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    for key in ("mem_stacked_bars", "mem_measured_vs_formula_plot"):
        assert "image/png" in values[key]
    assert "✓" in values["mem_fit_table"] and "✗" in values["mem_fit_table"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_measured_engine_memory_matches_the_formula(glue, stage):
    ratio = glue("01-memory")[f"mem_measured_over_formula_stage{stage}"]
    expected = memory.expected_measured_over_formula(stage, dp_ranks=2)
    assert ratio == pytest.approx(expected, abs=MEASURED_OVER_FORMULA_TOLERANCE)


def test_deepspeed_estimators_count_more_than_the_paper(glue):
    values = glue("01-memory")
    # 2 + 18/2 = 11 bytes against the paper's 2 + 14/2 = 9 at ZeRO-2 on 2 ranks.
    assert values["mem_estimator_zero2_over_formula"] == pytest.approx(11 / 9)
    assert values["mem_estimator_zero3_over_formula"] > 1


def test_activation_claims(glue):
    values = glue("01-memory")
    assert values["act_measured_over_adjusted"] == pytest.approx(1, abs=0.01)
    assert values["act_ckpt_measured_over_formula"] == pytest.approx(1, abs=0.01)
    assert values["act_ckpt_reduction"] > 5
    assert values["act_sdpa_over_eager"] < 1


def test_zero_partitions_exactly_half_on_two_ranks(glue):
    values = glue("02-zero")
    for stage in (1, 2, 3):
        assert values[f"zero{stage}_optimizer_state_ratio_2ranks"] == 0.5
    assert values["zero0_optimizer_state_ratio_2ranks"] == 1.0
    assert values["zero3_param_ratio_2ranks"] == 0.5
    assert values["zero2_param_ratio_2ranks"] == values["zero1_param_ratio_2ranks"] == 1.0
    for stage in (1, 2, 3):
        assert values[f"zero{stage}_grad_ratio_2ranks"] == 0.5
    for wrapper in ("FP16_Optimizer", "DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3"):
        assert wrapper in values["zero_wrappers_table"]


def test_zero_losses_agree_across_configurations(glue):
    values = glue("02-zero")
    assert values["zero_loss_max_abs_diff_across_stages"] < values["zero_bf16_spacing_at_loss"]
    assert values["zero_loss_max_abs_diff_zero1_vs_zero2"] == 0
    assert values["zero_loss_max_abs_diff_zero3_offloads"] == 0
    assert values["zero_tokens_per_s_zero2"] > 0 and values["zero_tokens_per_s_zero3"] > 0
    assert "image/png" in values["zero_tradeoff_plot"]


def test_zero_offload_ran_or_said_why(glue):
    values = glue("02-zero")
    table = values["zero_offload_table"]
    assert "zero2+cpu-opt" in table and "zero3+cpu-opt+cpu-param" in table
    if values["zero_nvme_ran"]:
        assert "zero3+nvme-opt+nvme-param" in table


def test_zero3_checkpoints_round_trip_exactly(glue):
    values = glue("02-zero")
    for key in ("resume_loss_max_abs_diff", "loaded_weights_max_abs_diff", "zero_to_fp32_max_abs_diff",
                "save_16bit_max_abs_diff"):
        assert values[f"zero3_ckpt_{key}"] == 0, key
    assert values["zero3_ckpt_zero_to_fp32_numel"] > 0


def test_precision_formats_and_vanishing_updates(glue):
    values = glue("03-precision")
    assert values["fp16_largest_finite"] == 65504
    assert values["bf16_spacing_near_1"] == 2.0 ** -7
    assert values["fp16_grad_underflow_unscaled"] > 0
    assert values["fp16_grad_underflow_scaled_2_16"] < values["fp16_grad_underflow_unscaled"]
    assert values["bf16_grad_underflow_unscaled"] == 0
    assert values["vanish_pure_bf16_final"] == 1.0
    assert values["vanish_master_final"] == pytest.approx(1.1, abs=1e-3)
    assert values["lost_updates_bf16_lr1e-5"] > 0.5 > values["lost_updates_fp32_lr1e-5"]
    assert "image/png" in values["vanish_plot"]


def test_dynamic_loss_scaling(glue):
    values = glue("03-precision")
    assert values["fp16_skipped_steps"] >= 1
    assert values["fp16_scale_after_first_overflow_ratio"] == 0.5
    assert values["fp16_scale_growth_events"] >= 1
    assert values["fp16_clean_steps_before_first_growth"] == values["fp16_loss_scale_window"]
    assert "image/png" in values["fp16_loss_scale_plot"]


def test_each_fp16_key_has_its_measured_effect(glue):
    values = glue("03-precision")
    assert values["fp16_hysteresis2_first_ratio"] == 1.0
    assert values["fp16_static_high_skipped"] == values["fp16_steps"]
    assert values["fp16_static_low_skipped"] == 0
    assert values["bf16_skipped_steps"] == 0
    assert values["fp16_big_window_growth_events"] == 0
    assert not math.isnan(values["fp16_skipped_steps"])
