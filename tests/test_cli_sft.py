"""The step-1 command line: --help, and a real 2-rank run under the deepspeed launcher."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dschat_lib import runtime


def test_help_lists_deepspeed_chat_flags():
    out = subprocess.run([sys.executable, "-m", "dschat_lib", "step1", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for flag in ("--data_path", "--data_split", "--model_name_or_path", "--per_device_train_batch_size",
                 "--max_seq_len", "--learning_rate", "--num_train_epochs", "--gradient_accumulation_steps",
                 "--lr_scheduler_type", "--num_warmup_steps", "--zero_stage", "--offload", "--dtype",
                 "--lora_dim", "--lora_module_name", "--only_optimize_lora", "--gradient_checkpointing",
                 "--output_dir", "--seed", "--sft_only_data_path"):
        assert flag in out, flag


def test_bad_argument_is_named():
    out = subprocess.run([sys.executable, "-m", "dschat_lib", "step1", "--output_dir", "x", "--zero_stage", "5"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "--zero_stage" in out.stderr


@pytest.mark.slow
def test_step1_on_two_ranks_saves_a_reloadable_model(tmp_path):
    out_dir = tmp_path / "sft"
    results = runtime.launch("dschat_lib", ["step1", "--output_dir", str(out_dir), "--max_steps", "6",
                                            "--per_device_train_batch_size", "8", "--zero_stage", "1",
                                            "--lora_dim", "4", "--train_base_with_lora",
                                            "--num_eval_prompts", "4", "--learning_rate", "3e-3",
                                            "--data_output_path", str(tmp_path / "cache")],
                             num_ranks=2, result_dir=tmp_path / "ranks")
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["micro_steps"] == 6 for r in results)
    report = json.loads((out_dir / "report.json").read_text())
    assert report["ppl_after"] < report["ppl_before"]
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert not any("lora" in name for name, _ in model.named_parameters())   # adapters merged
    assert (out_dir / "model.safetensors").exists()
    ids = tokenizer("\n\nHuman: Reverse this list: 1 2 3\n\nAssistant:", return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()
