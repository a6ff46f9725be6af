"""The ZeRO probe's configurations and its rank-side pieces that run without a launcher."""

import pytest

from dschat_lib import config, zero


def test_configurations_are_valid_deepspeed_configs():
    for name, spec in zero.CONFIGS.items():
        cfg = zero.engine_config(spec, micro_batch_size=2, learning_rate=1e-3, dtype="bf16",
                                 nvme_path="/tmp/nvme" if spec.uses_nvme else None)
        assert cfg["zero_optimization"]["stage"] == spec.stage, name
        if spec.stage == 3:
            assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_zero3_configs_come_last():
    """ZeRO-3 slows later work in the same process, so the probe runs it after the others."""
    stages = [spec.stage for spec in zero.CONFIGS.values()]
    assert stages.index(3) > max(i for i, s in enumerate(stages) if s < 3)


def test_nvme_configs_need_a_path():
    spec = zero.CONFIGS["zero3+nvme-opt+nvme-param"]
    with pytest.raises(config.ConfigError):
        zero.engine_config(spec, 2, 1e-3, "bf16", nvme_path=None)


def test_probe_refuses_unknown_configurations():
    with pytest.raises(KeyError):
        zero.probe(["zero4"], num_ranks=1)


def test_runs_frame_flattens_rank_results():
    run = {"name": "zero1", "optimizer_wrapper": "W", "local_param_numel": 10, "nvme_bytes": 0,
           "state_bytes": {"params_16bit": 20, "grads": 10, "fp32_master": 20, "adam_moments": 40},
           "tokens_per_s": 1.0, "losses": [3.0, 2.0]}
    frame = zero.runs_frame([{"rank": r, "world_size": 2, "runs": [run]} for r in range(2)])
    assert list(frame["rank"]) == [0, 1] and list(frame.final_loss) == [2.0, 2.0]
    assert frame.loc[0, "adam_moments_bytes"] == 40
