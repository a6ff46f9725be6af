"""The benchmark suite: its formulas, its cases, its results files, and the appendix rendered
from them (every number on that page must come from benchmarks/results/*.json)."""

import copy
import json
import sys

import pytest

from dschat_lib import benchmark
from harness import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import render  # noqa: E402
import run as bench_run  # noqa: E402
import suites  # noqa: E402

MICRO = dict(arch="cpu-tiny", vocab_size=64, seq_len=16, micro_batch_size=2, dtype="fp32", stage=0,
             name="micro", num_hidden_layers=1)


def test_training_flops_formula():
    # 6 N + 12 L H S: parameters dominate, attention adds a term growing with sequence length.
    assert benchmark.training_flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
    # The OPT-1.3B shape at 512 tokens: about 8 GFLOP per token, 94 % of it from 6 N.
    flops = benchmark.training_flops_per_token(1_315_758_080, 24, 2048, 512)
    assert 8.0e9 < flops < 8.4e9


def test_peak_on_cpu_is_a_measured_matmul():
    tflops, source = benchmark.peak_tflops("fp32")
    assert source == "measured matmul" and tflops > 0


def test_gpu_peaks_match_specific_names_first():
    names = [name for name, _ in benchmark.GPU_PEAK_TFLOPS]
    assert names.index("H100 PCIe") < names.index("H100")


def test_suites_cover_the_issue():
    gpu = suites.SUITES["gpu"]["sft"]
    assert {c["arch"] for c in gpu} == {"opt-125m", "opt-350m", "opt-1.3b"}
    assert {c["dtype"] for c in gpu} == {"bf16", "fp16"}
    recorded = [c for c in gpu if c.get("compare_with_recorded")]
    assert len(recorded) == 1
    ref = benchmark.RECORDED_OPT_1_3B_SFT
    assert (recorded[0]["micro_batch_size"], recorded[0]["seq_len"], recorded[0]["lora_dim"], recorded[0]["dtype"]) == \
        (ref["micro_batch_size"], ref["seq_len"], ref["lora_dim"], ref["dtype"])
    for suite in suites.SUITES.values():
        for case in suite["sft"]:
            assert {"arch", "vocab_size", "seq_len", "micro_batch_size", "dtype", "name"} <= set(case)


def test_plain_and_deepspeed_steps_measure_the_same_model():
    case = {k: v for k, v in MICRO.items() if k != "num_hidden_layers"}
    plain = benchmark.plain_pytorch_step(case, steps=1, warmup=1)
    deepspeed = benchmark.deepspeed_step(case, steps=1, warmup=1)
    assert plain["num_params"] == deepspeed["num_params"]
    for row in (plain, deepspeed):
        assert row["samples_per_s"] > 0 and row["peak_memory_bytes"] > 0
        assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * case["seq_len"])
        assert row["mfu"] == pytest.approx(row["model_tflops"] / row["peak_tflops"])


def test_ppo_flops_count_six_actor_and_five_critic_forwards():
    actor = {"num_params": 1000, "num_layers": 2, "hidden_size": 8}
    critic = {"num_params": 300, "num_layers": 1, "hidden_size": 4}
    forward = benchmark.forward_flops_per_token
    expected = 6 * forward(1000, 2, 8, 16) + 5 * forward(300, 1, 4, 16)
    assert benchmark.ppo_flops_per_token(actor, critic, 16) == pytest.approx(expected)
    assert benchmark.training_flops_per_token(1000, 2, 8, 16) == 3 * forward(1000, 2, 8, 16)


def test_reward_step_counts_a_pair_as_two_sequences():
    from dschat_lib import reward

    case = {k: v for k, v in MICRO.items() if k != "num_hidden_layers"}
    row = reward.benchmark_step(case, steps=1, warmup=1)
    assert row["samples_per_s"] > 0 and row["peak_memory_bytes"] > 0
    assert row["tokens_per_s"] == pytest.approx(2 * row["samples_per_s"] * case["seq_len"])
    lm = benchmark.deepspeed_step(case, steps=1, warmup=1)
    # the backbone plus a one-output value head, with no LM head: close to the causal LM's count
    assert abs(row["num_params"] - lm["num_params"]) < case["vocab_size"] * 32


def test_ppo_step_times_a_whole_iteration():
    from dschat_lib import ppo

    case = {k: v for k, v in MICRO.items() if k != "num_hidden_layers"}
    row = ppo.benchmark_step(case, steps=1, warmup=1)
    assert row["prompt_len"] + row["answer_len"] == case["seq_len"]
    assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * case["seq_len"])
    assert 0 < row["experience_share"] < 1
    assert row["flops_per_token"] > 3 * benchmark.training_flops_per_token(
        row["num_params"], row["num_layers"], row["hidden_size"], case["seq_len"])
    assert row["mfu"] == pytest.approx(row["model_tflops"] / row["peak_tflops"])


def test_every_suite_names_a_case_for_each_rlhf_step():
    for suite in suites.SUITES.values():
        assert set(suite["rlhf"]) == set(suites.PLUGGABLE_STEPS)


def test_rlhf_steps_plug_in_only_when_they_can(monkeypatch):
    monkeypatch.setattr(suites, "PLUGGABLE_STEPS", {"missing": "dschat_lib.no_such_module", "no hook": "json"})
    rows = bench_run.rlhf_steps(suites.SUITES["cpu"], 1, 0)
    assert rows["missing"]["status"].startswith("not measured") and "does not exist" in rows["missing"]["status"]
    assert "has no benchmark_step" in rows["no hook"]["status"]


# --------------------------------------------------------------------------- recorded results

@pytest.fixture(scope="module")
def results():
    return render.load_results()


def test_cpu_results_are_recorded_with_their_hardware(results):
    cpu = results["cpu"]
    env = cpu["environment"]
    assert env["accelerator"].startswith("cpu") and "load_average_1_5_15" in env and env["date"]
    assert cpu["sft"] and all("error" not in row for row in cpu["sft"])
    over = cpu["overhead"]
    assert over["overhead"] == pytest.approx(over["deepspeed"]["step_s"] / over["plain"]["step_s"] - 1)
    gen = cpu["generation"]
    assert gen["speedup_plain_over_zero3"] == pytest.approx(
        gen["plain"]["new_tokens_per_s"] / gen["zero3"]["new_tokens_per_s"])


def test_autotuner_result_names_its_choice(results):
    tuner = results["deepspeed-autotuner-cpu"]
    assert tuner["model"] == bench_run.AUTOTUNER_MODEL
    best = tuner["best"]
    assert any(e["stage"] == best["stage"] and e["micro_batch_size"] == best["micro_batch_size"]
               for e in tuner["experiments"])


def test_appendix_is_exactly_the_rendering_of_the_results(results):
    committed = render.APPENDIX.read_text()
    assert committed == render.render(results), "run `python benchmarks/run.py --render-only`"


def test_appendix_says_when_gpu_figures_are_missing(results):
    without_gpu = {k: v for k, v in results.items() if k != "gpu"}
    assert "GPU figures are not yet recorded" in render.render(without_gpu)
    fake_gpu = copy.deepcopy(results["cpu"])
    fake_gpu["sft"][0]["samples_per_s"] = 12345.6
    page = render.render({**without_gpu, "gpu": fake_gpu})
    assert "GPU figures are not yet recorded" not in page and "12345.6" in page


def test_results_files_are_valid_json():
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        json.loads(path.read_text())
