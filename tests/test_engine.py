import csv
from pathlib import Path

import pytest
import torch

from dschat_lib import engine as engine_lib
from dschat_lib import evaluation, lora, models, runtime, training

VOCAB = 64


def _model():
    return models.build_causal_lm("cpu-tiny", vocab_size=VOCAB, seed=0, num_hidden_layers=1,
                                  hidden_size=32, ffn_dim=64, num_attention_heads=2)


class _Loader:
    """A sized loader of deterministic counting batches."""

    def __init__(self, n, batch=4, seq=16):
        self.n, self.batch, self.seq = n, batch, seq

    def __len__(self):
        return self.n

    def __iter__(self):
        stream = training.counting_batches(VOCAB, self.batch, self.seq, seed=1)
        for _ in range(self.n):
            yield next(stream)


def _lm_loss(engine, batch):
    return engine(**batch).loss, {}


@pytest.fixture
def dist():
    runtime.init_distributed()
    yield
    runtime.teardown()


def test_settings_with_maps_lora_fields():
    s = engine_lib.TrainSettings().with_(lora_dim=8, lora_learning_rate=1e-2, zero_stage=2)
    assert s.lora.dim == 8 and s.lora.learning_rate == 1e-2 and s.zero_stage == 2


def test_ds_config_from_settings():
    cfg = engine_lib.build_ds_config(engine_lib.TrainSettings(zero_stage=3, offload=True, dtype="fp16"))
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert cfg["fp16"]["enabled"] and cfg["optimizer"]["type"] == "AdamW"


def test_extra_config_merges_into_the_settings_config():
    from dschat_lib import ppo

    settings = engine_lib.TrainSettings(zero_stage=2, dtype="bf16")
    cfg = engine_lib.build_ds_config(settings, extra=ppo.hybrid_engine_config(32))
    assert cfg["hybrid_engine"]["enabled"] and cfg["hybrid_engine"]["max_out_tokens"] == 32
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"]
    assert "hybrid_engine" not in engine_lib.build_ds_config(settings)


def test_unknown_scheduler_is_refused():
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        engine_lib.build_train_engine(_model(), engine_lib.TrainSettings(lr_scheduler_type="exp"), 10)


def test_fit_accumulates_schedules_evaluates_and_logs(dist, tmp_path):
    settings = engine_lib.TrainSettings(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                        lr_scheduler_type="linear", num_warmup_steps=2,
                                        learning_rate=1e-2, monitor_dir=str(tmp_path), job_name="t")
    engine = engine_lib.build_train_engine(_model(), settings, num_training_steps=6)
    evaluations = []

    def evaluate():
        evaluations.append(engine.global_steps)
        return {"eval_ppl": evaluation.perplexity(engine.module, _Loader(2))}

    history = training.fit(engine, _Loader(12), _lm_loss, evaluate=evaluate, eval_every=2,
                           progress=False, log=engine_lib.log_metrics)
    assert [r["step"] for r in history][-1] == 6              # 12 micro-batches / 2
    assert evaluations == [2, 4, 6]                           # every 2 optimizer steps, last included once
    lrs = [r["lr"] for r in history[1::2]]                    # after each optimizer step
    assert lrs[0] == pytest.approx(0.5e-2) and lrs[1] == pytest.approx(1e-2) and lrs[-1] == 0.0
    assert history[-1]["loss"] < history[0]["loss"]
    csv_files = list(Path(tmp_path).rglob("*loss*.csv"))
    assert csv_files, list(Path(tmp_path).rglob("*"))
    rows = list(csv.reader(csv_files[0].open()))
    assert len(rows) >= 12 and float(rows[-1][1]) == pytest.approx(history[-1]["loss"], rel=1e-4)
    runtime.teardown(engine)


def test_lora_engine_trains_only_adapters(dist):
    settings = engine_lib.TrainSettings(per_device_train_batch_size=4, learning_rate=1e-2,
                                        gradient_checkpointing=True).with_(lora_dim=4)
    engine = engine_lib.build_train_engine(_model(), settings, num_training_steps=3)
    frozen = {n: p.detach().clone() for n, p in engine.module.named_parameters() if not p.requires_grad}
    training.fit(engine, _Loader(3), _lm_loss, progress=False)
    assert all(torch.equal(frozen[n], p) for n, p in engine.module.named_parameters() if n in frozen)
    trainable, total = lora.trainable_parameters(engine.module)
    assert 0 < trainable < total
    runtime.teardown(engine)


def test_perplexity_is_token_weighted():
    model = _model()
    batch = next(iter(_Loader(1, batch=2, seq=8)))
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    short = {k: v.clone() for k, v in batch.items()}
    short["labels"][:, :6] = evaluation.IGNORE_INDEX           # only the last 2 tokens scored
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1),
                                                reduction="none").reshape(2, 7)
    expected = torch.exp((nll.sum() + nll[:, 5:].sum()) / (14 + 4)).item()
    assert evaluation.perplexity(model, [batch, short]) == pytest.approx(expected, rel=1e-5)
