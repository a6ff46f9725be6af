"""The arithmetic of PPO for language models, as pure functions on tensors.

Shapes: ``B`` sequences, ``T`` response tokens. ``mask[b, t]`` is 1 for a real response
token and 0 after the response ended (padding after EOS). Every function here is checked in
``tests/test_ppo_math.py`` against a direct computation on hand-made tensors.

The RLHF objective (Ouyang et al. 2022, eq. 2; Ziegler et al. 2019) maximises the reward
model's score ``r(x, y)`` while staying close to the reference (SFT) policy:

    R(x, y) = r(x, y) - β · KL(π(·|x) || π_ref(·|x))

The KL term is estimated per token from sampled tokens, ``log π(y_t) - log π_ref(y_t)``, so
each token gets a small penalty and the last token additionally gets the (clipped) score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where ``mask`` is 1."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  eps: float = 1e-8) -> torch.Tensor:
    """Normalise to unit variance (and zero mean unless ``shift_mean=False``) over masked
    positions; masked-out positions are returned as 0."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) under ``logits``: logits [B, T, V] and tokens [B, T] give [B, T]."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, tokens.unsqueeze(-1)).squeeze(-1)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row of ``mask`` [B, T] (0 for an all-zero row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * mask.long()).max(dim=1).values


def kl_penalized_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
                         mask: torch.Tensor, kl_coef: float, clip_score: float | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards: ``-β (log π - log π_ref)`` on every response token, plus the reward
    model's score (clipped to ±``clip_score``) on the last response token.

    A response that ended early with EOS gets its score on the EOS token; one that ran to the
    length limit gets it on its final token. Returns ``(rewards, kl)``, both [B, T] and zero
    after the response.
    """
    mask = mask.to(logprobs.dtype)
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    if clip_score is not None:
        scores = scores.clamp(-clip_score, clip_score)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores.to(rewards.dtype)
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over the response tokens.

    ``δ_t = r_t + γ V_{t+1} - V_t`` and ``A_t = δ_t + γλ A_{t+1}``. The episode ends at the
    last response token, so the value after it is 0; a response cut at the length limit is
    treated as ended too (its final token carries the score). Returns
    ``(advantages, returns)`` with ``returns = advantages + values``, zero after the response.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(rewards)
    next_advantage = torch.zeros_like(rewards[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        advantages[:, t] = next_advantage
        next_value = values[:, t]
    return advantages, (advantages + values) * mask


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), negated to be minimised.

    ``ratio = π/π_old``; the loss is ``max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε))`` averaged over
    response tokens. Also returns the fraction of tokens where clipping was active and an
    estimate of KL(π_old || π) — both standard health signals.
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((clipped > unclipped).float(), mask).item(),
                 # (ratio - 1) - log ratio: an unbiased, non-negative KL estimator (Schulman 2020)
                 "approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item()}
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: ``½ max((V - R)², (clip(V, V_old ± ε) - R)²)`` over response tokens.

    Clipping keeps the critic from moving far from the values the advantages were computed
    with, in the same spirit as the policy clip.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped = (values - returns) ** 2
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"value_clipfrac": masked_mean((clipped > unclipped).float(), mask).item()}
    return loss, stats


@dataclass
class AdaptiveKLController:
    """Adapts β so the measured KL tracks a target (Ziegler et al. 2019, section 2.2):
    ``β ← β · (1 + clip(KL/target - 1, -0.2, 0.2) · n/horizon)`` after ``n`` samples."""

    kl_coef: float
    target: float
    horizon: int
    max_relative_step: float = 0.2

    def update(self, current_kl: float, n_samples: int) -> float:
        error = max(-self.max_relative_step, min(self.max_relative_step, current_kl / self.target - 1))
        self.kl_coef *= 1 + error * n_samples / self.horizon
        return self.kl_coef


@dataclass
class FixedKLController:
    """A constant β (DeepSpeed-Chat's choice); same interface as the adaptive one."""

    kl_coef: float

    def update(self, current_kl: float, n_samples: int) -> float:
        return self.kl_coef
