import pytest

from dschat_lib.config import ConfigError, ds_config


def test_defaults_are_a_plain_bf16_zero0_config():
    cfg = ds_config()
    assert cfg["zero_optimization"] == {"stage": 0}
    assert cfg["bf16"] == {"enabled": True} and "fp16" not in cfg
    assert "train_batch_size" not in cfg


def test_fp16_is_dynamic_loss_scaling():
    cfg = ds_config(dtype="fp16", initial_scale_power=20)
    assert cfg["fp16"]["loss_scale"] == 0 and cfg["fp16"]["initial_scale_power"] == 20


def test_train_batch_size_from_world_size():
    assert ds_config(micro_batch_size=4, gradient_accumulation_steps=3, world_size=2)["train_batch_size"] == 24


def test_offload_blocks():
    cfg = ds_config(stage=3, offload_optimizer="cpu", offload_param="nvme", nvme_path="/tmp/x")
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": False, "nvme_path": "/tmp/x"}
    assert zero["stage3_prefetch_bucket_size"] == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(stage=4), "stage"),
    (dict(dtype="fp8"), "dtype"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps"),
    (dict(stage=0, offload_optimizer="cpu"), "offload_optimizer"),
    (dict(stage=2, offload_optimizer="nvme", nvme_path="/tmp"), "stage=3"),
    (dict(stage=2, offload_param="cpu"), "offload_param"),
    (dict(stage=3, offload_param="nvme"), "nvme_path"),
    (dict(stage=3, offload_param="disk"), "offload_param"),
])
def test_bad_combinations_name_the_argument(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ds_config(**kwargs)


def test_extra_is_merged_deeply():
    cfg = ds_config(stage=2, extra={"zero_optimization": {"overlap_comm": True}})
    assert cfg["zero_optimization"] == {"stage": 2, "overlap_comm": True}
