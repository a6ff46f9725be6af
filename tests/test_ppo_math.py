"""Each piece of PPO's arithmetic against a direct computation on hand-made tensors."""

import math

import pytest
import torch

from dschat_lib import ppo_math as pm

# Two responses of length 4: the first ended early (EOS at t=1), the second ran to the limit.
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)


def test_score_lands_on_last_response_token():
    logprobs = torch.zeros(2, 4)
    rewards, kl = pm.kl_penalized_rewards(logprobs, logprobs.clone(), torch.tensor([2.0, -3.0]),
                                          MASK, kl_coef=0.1, clip_score=None)
    assert rewards.tolist() == [[0, 2.0, 0, 0], [0, 0, 0, -3.0]]
    assert kl.abs().sum() == 0


def test_kl_penalty_per_token_and_score_clipping():
    logprobs = torch.tensor([[-1.0, -2.0, -9.0, -9.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, -1.0], [-1.0, -2.0, -1.0, -1.0]])
    rewards, kl = pm.kl_penalized_rewards(logprobs, ref, torch.tensor([10.0, 0.5]), MASK,
                                          kl_coef=0.5, clip_score=5.0)
    expected_kl = torch.tensor([[0.5, -1.0, 0, 0], [0, 1.0, 0, 0]])
    assert torch.allclose(kl, expected_kl)
    expected = -0.5 * expected_kl
    expected[0, 1] += 5.0          # 10 clipped to 5, on the EOS token
    expected[1, 3] += 0.5
    assert torch.allclose(rewards, expected)


def _gae_by_direct_sum(rewards, values, mask, gamma, lam):
    """A_t = sum_l (γλ)^l δ_{t+l}, with V = 0 after the last response token."""
    B, T = rewards.shape
    out = torch.zeros(B, T)
    for b in range(B):
        length = int(mask[b].sum())
        v = [values[b, t].item() if t < length else 0.0 for t in range(T + 1)]
        deltas = [rewards[b, t].item() + gamma * v[t + 1] - v[t] for t in range(length)]
        for t in range(length):
            out[b, t] = sum((gamma * lam) ** l * deltas[t + l] for l in range(length - t))
    return out


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_direct_sum(gamma, lam):
    torch.manual_seed(0)
    rewards = torch.randn(2, 4) * MASK
    values = torch.randn(2, 4)          # garbage after the end must not leak in
    advantages, returns = pm.gae(rewards, values, MASK, gamma, lam)
    expected = _gae_by_direct_sum(rewards, values, MASK, gamma, lam)
    assert torch.allclose(advantages, expected, atol=1e-6)
    assert torch.allclose(returns, (expected + values) * MASK, atol=1e-6)


def test_gae_with_lambda_one_and_gamma_one_is_return_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 0.8]])
    advantages, returns = pm.gae(rewards, values, torch.ones(1, 4), 1.0, 1.0)
    assert torch.allclose(returns, torch.ones(1, 4))
    assert torch.allclose(advantages, 1.0 - values)


@pytest.mark.parametrize("advantage, ratio, clipped", [
    (1.0, 1.5, True),     # good action, already much more likely: no further push
    (1.0, 0.5, False),    # good action made less likely: the unclipped term keeps the pull
    (-1.0, 0.5, True),    # bad action already much less likely: stop
    (-1.0, 1.5, False),   # bad action made more likely: full penalty
    (1.0, 1.1, False),    # inside the trust region
])
def test_policy_loss_clipping_cases(advantage, ratio, clipped):
    eps = 0.2
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(ratio), requires_grad=True)
    adv = torch.full((1, 1), advantage)
    loss, stats = pm.policy_loss(new, old, adv, torch.ones(1, 1), eps)
    expected = max(-advantage * ratio, -advantage * min(max(ratio, 1 - eps), 1 + eps))
    assert loss.item() == pytest.approx(expected)
    assert stats["clipfrac"] == (1.0 if clipped else 0.0)
    loss.backward()
    assert (new.grad.abs().item() == 0) == clipped   # clipped tokens give no gradient


def test_policy_loss_ignores_masked_tokens():
    old = torch.zeros(1, 2)
    new = torch.tensor([[0.0, 5.0]])
    adv = torch.tensor([[1.0, 100.0]])
    loss, _ = pm.policy_loss(new, old, adv, torch.tensor([[1.0, 0.0]]), 0.2)
    assert loss.item() == pytest.approx(-1.0)


def test_value_loss_clipping():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.1, 0.9]])
    loss, stats = pm.value_loss(values, old, returns, torch.ones(1, 2), cliprange_value=0.2)
    # token 0: unclipped (0.9)^2 ; token 1: clipped value 0.2 -> (0.8)^2 > (0.1)^2
    assert loss.item() == pytest.approx(0.5 * (0.81 + 0.64) / 2)
    assert stats["value_clipfrac"] == 0.5


def test_masked_whiten():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    white = pm.masked_whiten(values, mask)
    assert white[0, 3] == 0
    assert pm.masked_mean(white, mask).abs() < 1e-6
    assert pm.masked_mean(white ** 2, mask).item() == pytest.approx(1.0, rel=1e-4)


def test_token_logprobs_and_last_index():
    logits = torch.log(torch.tensor([[[0.25, 0.75], [0.5, 0.5]]]))
    assert torch.allclose(pm.token_logprobs(logits, torch.tensor([[1, 0]])),
                          torch.log(torch.tensor([[0.75, 0.5]])))
    assert pm.last_token_index(MASK).tolist() == [1, 3]


def test_kl_controllers():
    fixed = pm.FixedKLController(0.1)
    assert fixed.update(10.0, 64) == 0.1
    adaptive = pm.AdaptiveKLController(0.1, target=1.0, horizon=100)
    assert adaptive.update(2.0, 10) == pytest.approx(0.1 * (1 + 0.2 * 0.1))   # error clipped to +0.2
    assert adaptive.update(0.9, 10) == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))
