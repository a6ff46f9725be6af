"""Memory formulas, checked against the ZeRO paper, DeepSpeed's estimators and real models."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from dschat_lib import memory, models, training


def test_mixed_precision_adam_is_16_bytes_per_parameter_and_20_with_fp32_accumulation():
    assert sum(memory.bytes_per_param("mixed").values()) == 16
    assert sum(memory.bytes_per_param("mixed", grad_accum_fp32=True).values()) == 20
    assert sum(memory.bytes_per_param("fp32").values()) == 16
    assert memory.model_states_total(7e9) / memory.GB == pytest.approx(112)


def test_zero_paper_example_reproduces_figure_1():
    paper = memory.zero_paper_example()
    assert [round(paper[s], 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage, partitioned", [(0, set()), (1, {"fp32_master", "adam_momentum", "adam_variance"}),
                                                (2, {"fp32_master", "adam_momentum", "adam_variance", "grads_16bit"}),
                                                (3, {"fp32_master", "adam_momentum", "adam_variance", "grads_16bit",
                                                     "params_16bit"})])
def test_each_stage_divides_exactly_its_components(stage, partitioned):
    one = memory.model_states_bytes(1000, stage, 1)
    four = memory.model_states_bytes(1000, stage, 4)
    for name in one:
        assert four[name] == (one[name] / 4 if name in partitioned else one[name]), name


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        memory.model_states_bytes(10, stage=4)
    with pytest.raises(ValueError):
        memory.model_states_bytes(10, dp_ranks=0)
    with pytest.raises(ValueError):
        memory.bytes_per_param("fp8")


@pytest.mark.parametrize("name", ["cpu-tiny", "llama-tiny", "opt-350m", "opt-1.3b"])
def test_parameter_formula_matches_real_models(name):
    cfg = models.architecture_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert memory.parameter_count_from_config(cfg) == models.parameter_count(model)


def test_deepspeed_estimators_count_more_than_the_paper_and_agree_on_the_partitioned_part():
    n, largest = 10**9, 10**8
    # DeepSpeed counts 2 bytes of 16-bit params plus 18 partitioned bytes at ZeRO-2 (it adds
    # a 4-byte fp32 gradient partition to the paper's 2 + 12), so with many ranks both tend to 2n.
    estimate = memory.deepspeed_estimates(n, largest, dp_ranks=1)
    assert estimate["zero2"] == pytest.approx(20 * n)
    assert estimate["zero2"] - memory.model_states_total(n, 2, 1) == pytest.approx(4 * n)
    assert estimate["zero3"] == pytest.approx(4 * largest + 18 * n)


def test_fit_table_marks_what_fits():
    table = memory.fit_table(80, 8, sizes={"7B": 7e9})
    assert table.loc["7B", "ZeRO-0"].endswith("✗") and table.loc["7B", "ZeRO-3"].endswith("✓")


def test_activation_formula_and_measurement():
    assert memory.activation_bytes_per_layer(2048, 1, 4096, 32) == pytest.approx(2048 * 4096 * (34 + 5 * 32 * 2048 / 4096))
    assert memory.activation_bytes_per_layer(10, 2, 8, 2, checkpointing=True) == 2 * 10 * 2 * 8
    seq, batch_size = 16, 2
    model = models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, dtype=torch.bfloat16,
                                   num_hidden_layers=2)
    model.config._attn_implementation = "eager"
    model.train()
    batch = next(training.counting_batches(64, batch_size, seq))
    layers = list(model.model.decoder.layers)
    plain = memory.measure_activation_bytes(model, batch, layers)["layers"] / len(layers)
    adjusted = memory.hf_opt_eager_activation_bytes_per_layer(seq, batch_size, 128, 4)
    assert plain == pytest.approx(adjusted, rel=0.01)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = memory.measure_activation_bytes(model, batch, layers)["layers"] / len(layers)
    assert checkpointed == memory.activation_bytes_per_layer(seq, batch_size, 128, 4, checkpointing=True)


def test_engine_state_bytes_of_a_real_zero0_engine():
    """One rank, ZeRO-0, bf16: every category is the whole model, at 2/2/4/8 bytes."""
    import deepspeed

    from dschat_lib import config, runtime

    runtime.init_distributed()
    model = models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, num_hidden_layers=1)
    n = models.parameter_count(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config.ds_config(stage=0, micro_batch_size=2, dtype="bf16",
                                                              optimizer=config.adamw(1e-3)))
    try:
        batch = next(training.counting_batches(64, 2, 8))
        for _ in range(2):
            engine.backward(engine(**batch).loss)
            measured = memory.engine_state_bytes(engine)
            engine.step()
        assert measured == {"params_16bit": 2 * n, "grads": 2 * n, "fp32_master": 4 * n, "adam_moments": 8 * n}
        assert memory.local_parameter_numel(engine.module) == n
        assert sum(measured.values()) == memory.model_states_total(n, 0, 1)
    finally:
        runtime.teardown(engine)


def test_expected_ratio_for_deepspeeds_zero1():
    assert memory.expected_measured_over_formula(1, 2) == pytest.approx(9 / 10)
    assert memory.expected_measured_over_formula(3, 2) == 1.0
