import mmap
import os

import pytest
import torch

from dschat_lib import config, models, runtime, training


def _tiny_engine(stage=0, dtype="bf16"):
    import deepspeed

    model = models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, num_hidden_layers=1,
                                   hidden_size=32, ffn_dim=64, num_attention_heads=2)
    cfg = config.ds_config(stage=stage, micro_batch_size=2, dtype=dtype, optimizer=config.adamw(1e-3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def test_several_engines_in_one_process():
    """Teardown leaves nothing behind: a second init works and trains."""
    for _ in range(2):
        runtime.init_distributed()
        engine = _tiny_engine()
        history = training.run_steps(engine, training.counting_batches(64, 2, 16), 2, progress=False)
        assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in history)
        runtime.teardown(engine)
    import deepspeed
    assert not deepspeed.comm.is_initialized()


def test_seed_everything_repeats():
    runtime.seed_everything(3)
    a = torch.rand(3)
    runtime.seed_everything(3)
    assert torch.equal(a, torch.rand(3))


def test_default_dtype_on_cpu_is_bf16():
    assert runtime.default_dtype(torch.device("cpu")) == torch.bfloat16
    assert runtime.dtype_name(torch.float16) == "fp16"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_launch_two_ranks(tmp_path, launcher):
    results = runtime.launch("dschat_lib.probe", num_ranks=2, result_dir=tmp_path, launcher=launcher)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["rank_sum"] == 1.0 for r in results)


def test_launch_failure_names_the_problem(tmp_path):
    with pytest.raises(runtime.LaunchError, match="No module named"):
        runtime.launch("dschat_lib.no_such_module", num_ranks=1, result_dir=tmp_path)
    with pytest.raises(ValueError, match="launcher"):
        runtime.launch("dschat_lib.probe", launcher="mpirun")


def test_launch_does_not_leak_notebook_rank_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    results = runtime.launch("dschat_lib.probe", num_ranks=2, result_dir=tmp_path)
    assert [r["rank"] for r in results] == [0, 1]


def test_stale_shm_buffers_go_and_mapped_ones_stay(tmp_path):
    stale = tmp_path / (runtime.SHM_BUFFER_PREFIX + "0_127.0.0.1_1_0")
    live = tmp_path / (runtime.SHM_BUFFER_PREFIX + "0_127.0.0.1_1_1")
    unrelated = tmp_path / "some_other_segment"
    for path in (stale, live, unrelated):
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    with open(live, "r+b") as handle, mmap.mmap(handle.fileno(), mmap.PAGESIZE):
        removed = runtime.remove_stale_shm_buffers(tmp_path)
    assert removed == [stale.name]
    assert live.exists() and unrelated.exists() and not stale.exists()


def test_launch_leaves_no_shared_memory_behind(tmp_path):
    # DeepSpeed's CPU all-reduce names each rank's segment after the rendezvous port.
    port = runtime.free_port()
    runtime.launch("dschat_lib.probe", num_ranks=2, result_dir=tmp_path, master_port=port)
    left = [p.name for p in runtime.SHM_DIR.glob(f"{runtime.SHM_BUFFER_PREFIX}*_{port}_*")]
    assert left == []
