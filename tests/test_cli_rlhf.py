"""Steps 2 and 3 from the command line, on 2 CPU ranks under the DeepSpeed launcher, with tiny
sizes; then their outputs are reloaded the way the next step (or a user) loads them.

The launcher runs ``python -m dschat_lib step2`` / ``step3`` on each rank, with its own
``--local_rank=N`` argument added."""

import json

import pytest
import torch

from dschat_lib import models, pipeline, ppo, reward, runtime, tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A 1-layer causal LM saved like a step-1 output (the actor and the reward model's start)."""
    root = tmp_path_factory.mktemp("rlhf-cli")
    tok = tokenizer.load_tokenizer()
    model = models.create_hf_model("cpu-tiny", tok, seed=0, num_hidden_layers=1)
    models.save_hf_model(model, str(root / "actor-sft"), tok)
    return root


def test_help_names_deepspeed_chat_flags(capsys):
    for parser, flags in ((reward.build_parser(), ("--data_path", "--data_split", "--model_name_or_path",
                                                   "--zero_stage", "--lora_dim", "--per_device_train_batch_size")),
                          (ppo.build_parser(), ("--actor_model_name_or_path", "--critic_model_name_or_path",
                                                "--per_device_generation_batch_size", "--generation_batches",
                                                "--ppo_epochs", "--actor_zero_stage", "--critic_zero_stage",
                                                "--offload_reference_model", "--enable_hybrid_engine",
                                                "--enable_ema", "--unsup_coef", "--actor_lora_dim")),
                          (pipeline.build_parser(), ("--actor_model", "--reward_model", "--step3_args"))):
        text = parser.format_help()
        for flag in flags:
            assert flag in text, flag


def test_step2_on_two_ranks(workdir):
    out = workdir / "reward"
    results = runtime.launch("dschat_lib", [
        "step2", "--model_name_or_path", str(workdir / "actor-sft"), "--output_dir", str(out),
        "--per_device_train_batch_size", "8", "--max_steps", "6", "--max_eval_pairs", "32",
        "--dtype", "fp32", "--learning_rate", "1e-3", "--disable_progress"], num_ranks=2, timeout=600)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 for r in results)
    # Data-parallel ranks hold identical weights, so they measure the same table.
    assert [row["acc"] for row in results[0]["table"]] == [row["acc"] for row in results[1]["table"]]
    reloaded = models.load_reward_model(str(out))
    report = json.loads((out / "report.json").read_text())
    assert report["step"] == 2
    tok = tokenizer.load_tokenizer(str(out))
    scores = reward.score_responses(reloaded, tok, ["\n\nHuman: Repeat this list: 1 2 3\n\nAssistant:"], [" 1 2 3"])
    assert len(scores) == 1 and scores[0] == scores[0]


def test_step3_on_two_ranks(workdir):
    if not (workdir / "reward" / "reward_model.json").exists():
        pytest.skip("needs the step-2 output of test_step2_on_two_ranks")
    out = workdir / "rlhf"
    results = runtime.launch("dschat_lib", [
        "step3", "--actor_model_name_or_path", str(workdir / "actor-sft"),
        "--critic_model_name_or_path", str(workdir / "reward"), "--output_dir", str(out),
        "--per_device_generation_batch_size", "4", "--per_device_training_batch_size", "4",
        "--max_iterations", "2", "--max_answer_seq_len", "8", "--per_device_eval_prompts", "8",
        "--enable_ema", "--unsup_coef", "0.1", "--kl_ctl", "adaptive", "--init_kl_coef", "0.05",
        "--dtype", "fp32", "--disable_progress"], num_ranks=2, timeout=600)
    assert [r["world_size"] for r in results] == [2, 2]
    history = results[0]["history"]
    assert len(history) == 2
    assert all("ptx_loss" in row for row in history)          # PPO-ptx mixed in
    assert history[0]["kl_coef"] == pytest.approx(0.05)        # adaptive β starts at init_kl_coef
    # Metrics are averaged over ranks, so both ranks log the same numbers.
    assert results[0]["history"][-1]["reward"] == pytest.approx(results[1]["history"][-1]["reward"])
    tok = tokenizer.load_tokenizer(str(out / "actor"))
    actor = models.load_hf_model(str(out / "actor"), tok)
    start = models.load_hf_model(str(workdir / "actor-sft"), tok)
    assert any(not torch.equal(a, b) for a, b in zip(actor.parameters(), start.parameters()))
    models.load_reward_model(str(out / "critic"), tok)
    models.load_hf_model(str(out / "actor_ema"), tok)


def test_e2e_chains_the_three_steps(tmp_path):
    """``python -m dschat_lib e2e`` in-process with minimal sizes: each step reads the previous
    step's saved output, and the final actor differs from the step-1 actor."""
    from dschat_lib import cli

    code = cli.main(["e2e", "--output_dir", str(tmp_path), "--dtype", "fp32",
                     "--step1_args", "--max_steps 3 --num_eval_prompts 4 --per_device_train_batch_size 8",
                     "--step2_args", "--max_steps 3 --max_eval_pairs 16 --per_device_train_batch_size 8",
                     "--step3_args", "--max_iterations 1 --per_device_generation_batch_size 4 "
                                     "--per_device_training_batch_size 4 --per_device_eval_prompts 4"])
    assert code == 0
    reports = [json.loads((tmp_path / d / "report.json").read_text())
               for d in ("actor-sft", "reward", "rlhf")]
    assert [r["step"] for r in reports] == [1, 2, 3]
    tok = tokenizer.load_tokenizer(str(tmp_path / "actor-sft"))
    sft = models.load_hf_model(str(tmp_path / "actor-sft"), tok)
    rlhf = models.load_hf_model(str(tmp_path / "rlhf" / "actor"), tok)
    assert any(not torch.equal(a, b) for a, b in zip(sft.parameters(), rlhf.parameters()))
