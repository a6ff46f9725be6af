"""Step 3's data flow: masks, where rewards land, advantages, EMA, and a real tiny PPO iteration."""

import pytest
import torch

from dschat_lib import data, models, ppo, ppo_math, runtime, tasks, tokenizer
from dschat_lib.engine import TrainSettings

EOS, PAD = 2, 0


def test_response_mask_stops_after_the_first_eos():
    response = torch.tensor([[5, EOS, PAD, PAD],     # ended early: EOS counts, padding does not
                             [5, 6, 7, 8],           # ran to the length limit: all count
                             [EOS, PAD, PAD, PAD],   # empty answer: only the EOS
                             [5, EOS, 9, EOS]])      # anything after the first EOS is ignored
    assert ppo.response_mask(response, EOS).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1],
                                                         [1, 0, 0, 0], [1, 1, 0, 0]]


def test_position_ids_start_at_zero_after_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert ppo.position_ids(mask).tolist() == [[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]]


def _experience(mask, scores, logprobs=None, ref=None, values=None):
    B, T = mask.shape
    return {"mask": mask, "scores": scores,
            "logprobs": torch.zeros(B, T) if logprobs is None else logprobs,
            "ref_logprobs": torch.zeros(B, T) if ref is None else ref,
            "values": torch.zeros(B, T) if values is None else values}


def test_score_lands_on_eos_or_on_the_last_token_at_the_limit():
    response = torch.tensor([[5, EOS, PAD, PAD], [5, 6, 7, 8]])
    mask = ppo.response_mask(response, EOS)
    settings = ppo.PPOSettings(whiten_advantages=False, gamma=1.0, lam=1.0, clip_reward_value=None)
    out = ppo.add_advantages(_experience(mask, torch.tensor([3.0, -1.0])), settings, kl_coef=0.1)
    assert out["rewards"].tolist() == [[0, 3.0, 0, 0], [0, 0, 0, -1.0]]
    # γ = λ = 1 and zero values: every token's advantage is the return to go, i.e. the score.
    assert out["advantages"].tolist() == [[3.0, 3.0, 0, 0], [-1.0, -1.0, -1.0, -1.0]]


def test_add_advantages_combines_kl_penalty_clipping_and_gae_like_the_direct_formula():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    logprobs, ref, values = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    settings = ppo.PPOSettings(whiten_advantages=False, gamma=0.9, lam=0.8, clip_reward_value=2.0)
    out = ppo.add_advantages(_experience(mask, torch.tensor([5.0, 0.5]), logprobs, ref, values),
                             settings, kl_coef=0.2)
    rewards = -0.2 * (logprobs - ref) * mask
    rewards[0, 2] += 2.0      # 5 clipped to 2
    rewards[1, 3] += 0.5
    assert torch.allclose(out["rewards"], rewards)
    for b in range(2):
        n = int(mask[b].sum())
        v = values[b, :n].tolist() + [0.0]
        for t in range(n):
            direct = sum((0.9 * 0.8) ** l * (rewards[b, t + l].item() + 0.9 * v[t + l + 1] - v[t + l])
                         for l in range(n - t))
            assert out["advantages"][b, t].item() == pytest.approx(direct, abs=1e-5)


def test_whitened_advantages_have_zero_mean_unit_variance_over_response_tokens():
    torch.manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = ppo.add_advantages(_experience(mask, torch.tensor([2.0, -1.0]), values=torch.randn(2, 4)),
                             ppo.PPOSettings(), kl_coef=0.1)
    adv = out["advantages"]
    assert ppo_math.masked_mean(adv, mask).item() == pytest.approx(0.0, abs=1e-5)
    assert ppo_math.masked_mean(adv ** 2, mask).item() == pytest.approx(1.0, abs=1e-3)
    assert (adv * (1 - mask)).abs().sum() == 0


def test_ema_update_formula():
    model, ema = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    old = ema.weight.detach().clone()
    ppo.update_ema(ema, model, decay=0.9)
    assert torch.allclose(ema.weight, 0.9 * old + 0.1 * model.weight)


def test_settings_reject_unknown_kl_controller():
    with pytest.raises(ValueError):
        ppo.PPOSettings(kl_ctl="sometimes")
    assert isinstance(ppo.PPOSettings(kl_ctl="adaptive").kl_controller(), ppo_math.AdaptiveKLController)


def test_parser_speaks_deepspeed_chat_flags():
    args = ppo.build_parser().parse_args(
        ["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c", "--output_dir", "o",
         "--actor_zero_stage", "2", "--critic_lora_dim", "4", "--enable_ema", "--unsup_coef", "0.5",
         "--per_device_generation_batch_size", "8", "--generation_batches", "2", "--ppo_epochs", "3"])
    settings, actor, critic = ppo.settings_from_args(args)
    assert (settings.generation_batches, settings.ppo_epochs, settings.enable_ema) == (2, 3, True)
    assert settings.unsup_coef == 0.5 and settings.updates_per_iteration() == 3 * 1
    assert actor.zero_stage == 2 and critic.zero_stage == 0
    assert critic.lora.dim == 4 and actor.lora.dim == 0


@pytest.fixture(scope="module")
def tiny_engines():
    """Four real DeepSpeed engines on 1-layer models (untrained: only the data flow is tested)."""
    runtime.seed_everything(0)
    runtime.init_distributed()
    tok = tokenizer.load_tokenizer()

    def lm():
        return models.create_hf_model("cpu-tiny", tok, seed=0, num_hidden_layers=1)

    def rm():
        return models.create_reward_model("cpu-tiny", tok, seed=1, num_hidden_layers=1)

    settings = ppo.PPOSettings(per_device_generation_batch_size=6, per_device_training_batch_size=4,
                               max_answer_seq_len=8, enable_ema=True)
    train = TrainSettings(per_device_train_batch_size=4, learning_rate=1e-3, dtype="fp32",
                          lr_scheduler_type="constant")
    engines = ppo.build_engines(lm(), lm(), rm(), rm(), settings, train, train, num_iterations=2)
    rows = data.load_shipped("eval")[:6]
    collate = data.PromptCollator(tok.pad_token_id, 32)
    batch = collate([{"prompt_ids": data.encode_prompt(tok, r["prompt"]), "prompt": r["prompt"]} for r in rows])
    yield engines, tok, settings, batch
    runtime.teardown(engines.actor, engines.ref, engines.critic, engines.reward)


def test_experience_shapes_masks_and_zero_kl_at_the_start(tiny_engines):
    engines, tok, settings, batch = tiny_engines
    exp = ppo.make_experience(engines, batch, tok, settings)
    B, P, A = 6, 32, settings.max_answer_seq_len
    assert exp["sequences"].shape == (B, P + A) and exp["mask"].shape == (B, A)
    assert torch.equal(exp["sequences"][:, :P], batch["input_ids"])
    for key in ("logprobs", "ref_logprobs", "values"):
        assert exp[key].shape == (B, A)
    assert exp["scores"].shape == (B,)
    assert torch.equal(exp["mask"], ppo.response_mask(exp["sequences"][:, P:], tok.eos_token_id))
    # Actor and reference start as the same weights: identical log-probs, zero KL.
    assert torch.allclose(exp["logprobs"], exp["ref_logprobs"], atol=1e-5)
    assert (exp["logprobs"] <= 0).all()
    assert len(exp["responses"]) == B and exp["prompts"] == batch["prompt"]


def test_one_ppo_iteration_moves_the_actor_and_keeps_the_reference(tiny_engines):
    engines, tok, settings, batch = tiny_engines
    ref_before = [p.detach().clone() for p in engines.ref.module.parameters()]
    actor_before = [p.detach().clone() for p in engines.actor.module.parameters()]
    history = ppo.train_ppo(engines, tok, [batch], settings, num_iterations=1, scorer=tasks.score,
                            progress=False)
    row = history[0]
    for key in ("reward", "truth", "kl", "response_len", "eos_fraction", "policy_loss", "value_loss",
                "clipfrac", "value_clipfrac", "approx_kl", "explained_var"):
        assert key in row and row[key] == row[key], key   # present and not NaN
    assert 0 <= row["truth"] <= 1 and 1 <= row["response_len"] <= settings.max_answer_seq_len
    assert all(torch.equal(a, b) for a, b in zip(ref_before, engines.ref.module.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(actor_before, engines.actor.module.parameters()))
    # The EMA moved a little towards the actor, not all the way.
    ema_w = dict(engines.ema.named_parameters())
    name, actor_w = next((n, p) for n, p in engines.actor.module.named_parameters() if n in ema_w)
    assert not torch.equal(ema_w[name], actor_w)


def test_evaluating_the_reference_as_policy_gives_zero_kl(tiny_engines):
    engines, tok, settings, batch = tiny_engines
    result = ppo.evaluate_policy(engines, tok, [batch], settings, tasks.score, seed=3,
                                 policy=engines.ref.module)
    assert result["kl"] == pytest.approx(0.0, abs=1e-5)
    again = ppo.evaluate_policy(engines, tok, [batch], settings, tasks.score, seed=3,
                                policy=engines.ref.module)
    assert again["responses"] == result["responses"]      # a fixed seed gives the same samples


def test_an_update_makes_positive_advantage_tokens_more_likely(tiny_engines):
    """The sign convention end to end: after PPO updates on hand-set advantages, tokens with
    A > 0 gained probability and tokens with A < 0 lost it."""
    engines, tok, settings, batch = tiny_engines
    exp = ppo.make_experience(engines, batch, tok, settings)
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])[:, None]
    exp = {**exp, "advantages": sign * exp["mask"], "returns": exp["values"]}
    for _ in range(3):
        ppo.ppo_update(engines, exp, settings)
    with torch.no_grad():
        engines.actor.eval()
        new = ppo.response_logprobs(engines.actor, exp["sequences"], exp["attention_mask"], exp["prompt_len"])
        engines.actor.train()
    change = ((new - exp["logprobs"]) * exp["mask"]).sum(1) / exp["mask"].sum(1)
    assert (change[sign[:, 0] > 0] > 0).all() and (change[sign[:, 0] < 0] < 0).all(), change


def test_lora_actor_trains_and_saves_merged(tmp_path):
    """Actor and critic with LoRA (only the adapters train); the saved actor is a plain HF model
    with the adapters folded in."""
    runtime.init_distributed()
    tok = tokenizer.load_tokenizer()
    lm = lambda: models.create_hf_model("cpu-tiny", tok, seed=0, num_hidden_layers=1)  # noqa: E731
    rm = lambda: models.create_reward_model("cpu-tiny", tok, seed=1, num_hidden_layers=1)  # noqa: E731
    settings = ppo.PPOSettings(per_device_generation_batch_size=4, per_device_training_batch_size=4,
                               max_answer_seq_len=6)
    train = TrainSettings(per_device_train_batch_size=4, learning_rate=1e-2, dtype="fp32",
                          lr_scheduler_type="constant").with_(lora_dim=4)
    engines = ppo.build_engines(lm(), lm(), rm(), rm(), settings, train, train, num_iterations=1)
    try:
        rows = data.load_shipped("eval")[:4]
        batch = data.PromptCollator(tok.pad_token_id, 32)(
            [{"prompt_ids": data.encode_prompt(tok, r["prompt"]), "prompt": r["prompt"]} for r in rows])
        ppo.train_ppo(engines, tok, [batch], settings, num_iterations=1, progress=False)
        ppo.save_models(engines, str(tmp_path), tok, train, train)
    finally:
        runtime.teardown(engines.actor, engines.ref, engines.critic, engines.reward)
    saved = models.load_hf_model(str(tmp_path / "actor"), tok)
    assert not any("lora" in name for name, _ in saved.named_parameters())
    start = lm()
    assert any(not torch.allclose(a, b) for a, b in zip(saved.parameters(), start.parameters()))
