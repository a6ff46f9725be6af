"""Claims the autotuning and scaling-out chapters make, checked on the values their notebooks
recorded (see conftest.glue)."""

import json

import pytest

from harness import ROOT


@pytest.fixture(scope="module")
def tuning(glue):
    return glue("10-autotuning")


@pytest.fixture(scope="module")
def scaling(glue):
    return glue("11-scaling-out")


def test_estimators_plan_opt_1_3b(tuning):
    assert 1.2 < tuning["autotune_opt13b_params_b"] < 1.5
    # ZeRO-0 model states of OPT-1.3B do not fit a 24 GB card; ZeRO-3 over 8 GPUs does easily.
    assert tuning["autotune_opt13b_z0_gib"] > 24
    assert tuning["autotune_opt13b_z3_8gpu_gib"] < tuning["autotune_opt13b_z0_gib"] / 4


def test_ladder_starts_out_of_budget_and_finds_a_rung_that_fits(tuning):
    assert tuning["autotune_ladder_start_mib"] > tuning["autotune_ladder_budget_mib"]
    assert tuning["autotune_ladder_first_fit_mib"] <= tuning["autotune_ladder_budget_mib"]
    assert tuning["autotune_ladder_first_fit"] != "start"
    assert tuning["autotune_ladder_rungs"] == (9 if tuning["autotune_ladder_nvme_ran"] else 8)
    # Checkpointing keeps less activation memory than the rung before it.
    assert tuning["autotune_ladder_ckpt_activation_ratio"] < 1
    assert "image/png" in tuning["autotune_ladder_plot"]


def test_sweep_choice_fits_and_is_at_least_as_fast_as_the_default(tuning):
    assert tuning["autotune_best_peak_mib"] <= tuning["autotune_sweep_budget_mib"]
    assert tuning["autotune_speedup_over_default"] >= 1.0
    assert tuning["autotune_speedup_over_default"] == pytest.approx(
        tuning["autotune_best_samples_per_s"] / tuning["autotune_default_samples_per_s"])
    assert tuning["autotune_sweep_ran"] + tuning["autotune_sweep_skipped"] == tuning["autotune_sweep_configs"]
    assert tuning["autotune_sweep_skipped"] >= 1          # the budget ruled something out unrun
    assert tuning["autotune_config_micro_batch"] == tuning["autotune_best_micro_batch"]
    assert tuning["autotune_best"].startswith(f"z{tuning['autotune_best_stage']} mb{tuning['autotune_best_micro_batch']}")
    assert "image/png" in tuning["autotune_sweep_plot"]


def test_deepspeed_autotuner_comparison_comes_from_a_recorded_run(tuning):
    recorded = json.loads((ROOT / "benchmarks" / "results" / "deepspeed-autotuner-cpu.json").read_text())
    if tuning["autotune_deepspeed_source"].startswith("recorded"):
        assert tuning["autotune_deepspeed_stage"] == recorded["best"]["stage"]
        assert tuning["autotune_deepspeed_micro_batch"] == recorded["best"]["micro_batch_size"]
        assert recorded["environment"]["date"] in tuning["autotune_deepspeed_source"]
    assert tuning["autotune_deepspeed_experiments"] >= 2


def test_probe_runs_under_both_launchers(scaling):
    assert scaling["scaling_probe_ok"] is True
    assert scaling["scaling_num_ranks"] >= 2


def test_hostfile_and_placement_claims(scaling):
    assert scaling["scaling_bad_hostfile_problems"] == 4
    assert scaling["scaling_include_ranks"] == 4
    assert scaling["scaling_exclude_ranks"] == 7
    assert scaling["scaling_cache_preparers"] == 2          # one per node


def test_environment_propagation_claims(scaling):
    exported = scaling["scaling_exported_without_file"].split(", ")
    assert {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "PYTHONPATH"} == set(exported)
    assert "HF_HOME" in scaling["scaling_dropped_without_file"]
    assert "CUDA_VISIBLE_DEVICES" in scaling["scaling_dropped_without_file"]


def test_errors_are_reproduced_with_their_fixes(scaling):
    assert "unrecognized arguments: --local_rank=0" in scaling["scaling_local_rank_error"]
    assert scaling["scaling_no_local_rank_exit"] == 0
    assert "deepspeed_config" in scaling["scaling_missing_config_error"].lower() or \
        "config" in scaling["scaling_missing_config_error"].lower()
    assert scaling["scaling_config_micro_batch"] == 2
    port = scaling["scaling_port_error"].lower()
    assert "eaddrinuse" in port or "address already in use" in port
    assert "allocate" in scaling["scaling_oom_error"].lower()
