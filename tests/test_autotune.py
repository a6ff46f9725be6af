"""dschat_lib.autotune: configs, DeepSpeed's estimators, the ladder's order, and real trials."""

import json
from dataclasses import replace

import pytest
import torch

from dschat_lib import autotune, models, training

VOCAB, SEQ = 64, 16


def micro_model():
    return models.build_causal_lm("cpu-tiny", vocab_size=VOCAB, seed=0, num_hidden_layers=1)


def micro_batches(micro_batch_size):
    return training.counting_batches(VOCAB, micro_batch_size, SEQ, seed=0)


def test_trial_configs_are_valid_and_sized_to_the_model():
    z3 = autotune.Trial(stage=3, micro_batch_size=4, offload_param="cpu", offload_optimizer="cpu").ds_config(10**6, 128)
    zero = z3["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == "cpu"
    # Buckets follow the model, not DeepSpeed's 5e8-element default (1 GB of 16-bit buffer).
    assert zero["reduce_bucket_size"] < 5e8 and zero["reduce_bucket_size"] >= autotune.MIN_BUCKET_ELEMENTS
    z2 = autotune.Trial(stage=2).ds_config(10**6, 128)["zero_optimization"]
    assert not any(k.startswith("stage3") for k in z2)
    nvme = autotune.Trial(stage=3, offload_param="nvme", offload_optimizer="nvme", nvme_path="/tmp/x").ds_config(10**6)
    assert nvme["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert autotune.Trial(stage=2, micro_batch_size=4, gradient_checkpointing=True).label == "z2 mb4 ckpt bf16"


def test_estimates_are_deepspeeds_and_shrink_down_the_ladder():
    params, largest = 1_000_000, 100_000
    z0 = autotune.model_state_estimate(params, largest, 0, world_size=8)["device_bytes"]
    assert z0 == 20 * params                       # 2 (16-bit weights) + 18 per parameter, unpartitioned
    z2 = autotune.model_state_estimate(params, largest, 2, world_size=8)["device_bytes"]
    assert z2 == 2 * params + 18 * params // 8
    offload = autotune.model_state_estimate(params, largest, 2, world_size=8, offload_optimizer=True)
    assert offload["device_bytes"] == 2 * params and offload["host_bytes"] > 0
    z3_all = autotune.model_state_estimate(params, largest, 3, 8, offload_optimizer=True, offload_param=True)
    assert z3_all["device_bytes"] == 4 * largest
    assert z0 > z2 > offload["device_bytes"] > z3_all["device_bytes"]


def test_parameter_counts_share_tied_weights_and_work_on_meta():
    model = micro_model()
    total, largest = autotune.parameter_counts(model)
    assert total == models.parameter_count(model)
    cfg = model.config                                   # with a 64-token vocabulary the largest
    assert largest == cfg.hidden_size * cfg.ffn_dim + cfg.ffn_dim   # module is the first MLP layer
    with torch.device("meta"):
        meta = micro_model()
    assert autotune.parameter_counts(meta) == (total, largest)


def test_ladder_is_cumulative_and_in_order():
    start = autotune.Trial(stage=0, micro_batch_size=8, dtype="fp32")
    rungs = autotune.ladder_trials(start)
    names = [name for name, _, _ in rungs]
    assert names == ["start", "micro-batch 1", "gradient checkpointing", "ZeRO-2", "optimizer offload",
                     "ZeRO-3", "parameter offload", "16-bit"]            # NVMe only with a path
    trials = [t for _, _, t in rungs]
    assert all(t.samples_per_step == 8 for t in trials)                  # global batch kept
    last = trials[-1]
    assert (last.stage, last.gradient_checkpointing, last.offload_optimizer, last.offload_param, last.dtype) == \
        (3, True, "cpu", "cpu", "bf16")
    with_nvme = autotune.ladder_trials(start, nvme_path="/tmp/nvme")
    assert with_nvme[-1][0] == "NVMe" and with_nvme[-1][2].offload_param == "nvme"


def test_extrapolation_is_the_line_through_the_last_two_points():
    assert autotune._extrapolate([(1, 10), (2, 14), (4, 20)], 8) == 32


def test_run_trial_measures_a_real_engine():
    row = autotune.run_trial(autotune.Trial(micro_batch_size=2), micro_model, micro_batches, steps=1)
    assert row["samples_per_s"] > 0 and row["step_s"] > 0
    assert row["peak_bytes"] > row["state_bytes"] > 0
    # Model states: at least the bf16 weights plus fp32 master weights of every parameter.
    assert row["state_bytes"] >= 6 * models.parameter_count(micro_model())


def test_sweep_picks_the_fastest_that_fits_and_writes_its_config(tmp_path):
    result = autotune.sweep(micro_model, micro_batches, budget_bytes=2**34, stages=(0,),
                            micro_batch_sizes=(2,), checkpointing=(False,), steps=1, progress=None)
    ran = [r for r in result.rows if r["status"] == "ran: fits"] + [result.default]
    assert result.best["samples_per_s"] == max(r["samples_per_s"] for r in ran)
    assert result.speedup_over_default >= 1.0
    path = autotune.write_ds_config(result.best, tmp_path / "best.json", 10**5)
    assert json.loads(path.read_text())["train_micro_batch_size_per_gpu"] == result.best["micro_batch_size"]


def test_sweep_skips_what_the_estimator_rules_out():
    tiny_budget = 1024                                       # far below any model's states
    with pytest.raises(RuntimeError, match="no configuration fits"):
        autotune.sweep(micro_model, micro_batches, budget_bytes=tiny_budget, stages=(0, 3),
                       micro_batch_sizes=(1,), checkpointing=(False,), steps=1, progress=None)


def test_autotuner_config_lets_deepspeed_choose_the_micro_batch():
    cfg = autotune.autotuner_config("/tmp/work")
    assert cfg["train_micro_batch_size_per_gpu"] == "auto"
    assert cfg["autotuning"]["enabled"] and cfg["autotuning"]["fast"]
    assert cfg["autotuning"]["results_dir"].startswith("/tmp/work")


def test_trial_rejects_impossible_combinations():
    from dschat_lib.config import ConfigError

    with pytest.raises(ConfigError):
        replace(autotune.Trial(), offload_param="cpu").ds_config(1000)      # needs ZeRO-3
