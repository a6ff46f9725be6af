"""Step 3: RLHF — optimise the SFT policy against the reward model with PPO.

Four models take part (Ouyang et al. 2022; Ziegler et al. 2019):

- the **actor** π (trained): starts as the SFT model and writes the responses;
- the **reference** π_ref (frozen): the SFT model, the anchor of the KL penalty;
- the **critic** V (trained): starts as the reward model; predicts the return per token;
- the **reward model** r (frozen): scores each finished response once.

Each is a DeepSpeed engine with its own ZeRO stage, offload, precision and LoRA settings.

One **iteration** is: sample responses to ``generation_batches`` batches of prompts
(:func:`make_experience`), turn scores and KL into per-token rewards and advantages
(:func:`add_advantages`), then run ``ppo_epochs`` passes of clipped-PPO updates over shuffled
mini-batches of that experience (:func:`ppo_update`). The arithmetic is in
:mod:`dschat_lib.ppo_math`; this module is the data flow around it.

**Data.** Prompts only (step-3 share of the preference data), left-padded to
``max_prompt_seq_len`` so that generation continues right after every prompt's last token.

**Logged per iteration** (see :data:`METRICS`): the reward-model score, the ground-truth score,
the KL to the reference, response length, the losses and clip fractions.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from dschat_lib import ppo_math as pm
from dschat_lib.engine import TrainSettings, build_train_engine, log_metrics

# --------------------------------------------------------------------------- settings

#: Default PPO constants, in one place. Where DeepSpeed-Chat has the same constant its value
#: is used (kl_ctl 0.1, clip_reward_value 5, cliprange 0.2, cliprange_value 0.2, gamma 1,
#: lam 0.95, EMA 0.992); adaptive-KL values follow Ziegler et al. 2019.
DEFAULT_KL_COEF = 0.1
DEFAULT_CLIP_REWARD_VALUE = 5.0
DEFAULT_CLIPRANGE = 0.2
DEFAULT_CLIPRANGE_VALUE = 0.2
DEFAULT_GAMMA = 1.0
DEFAULT_LAM = 0.95
DEFAULT_EMA_DECAY = 0.992
DEFAULT_TARGET_KL = 6.0
DEFAULT_KL_HORIZON = 10_000
KL_CONTROLLERS = ("fixed", "adaptive")


@dataclass
class PPOSettings:
    """Everything about step 3 that is not a per-model engine option (those are
    :class:`dschat_lib.engine.TrainSettings`, one for the actor and one for the critic)."""

    # experience
    per_device_generation_batch_size: int = 16  # prompts per generation batch, per rank
    generation_batches: int = 1                 # generation batches collected per PPO update
    max_answer_seq_len: int = 16                # new tokens generated at most
    temperature: float = 1.0                    # sampling temperature (1 = the policy itself)
    # rewards
    kl_ctl: str = "fixed"                       # "fixed" or "adaptive" β
    init_kl_coef: float = DEFAULT_KL_COEF       # β in r - β·KL
    target_kl: float = DEFAULT_TARGET_KL        # adaptive: KL (nats per response) to track
    kl_horizon: int = DEFAULT_KL_HORIZON        # adaptive: samples over which β adapts
    clip_reward_value: float | None = DEFAULT_CLIP_REWARD_VALUE  # reward-model score clipped to ±this
    whiten_rewards: bool = False                # scale per-token rewards to unit variance
    whiten_advantages: bool = True              # normalise advantages per update (zero mean, unit var)
    gamma: float = DEFAULT_GAMMA                # discount per token
    lam: float = DEFAULT_LAM                    # GAE λ
    # update
    per_device_training_batch_size: int = 16    # experiences per PPO mini-batch, per rank
    ppo_epochs: int = 1                         # passes over each batch of experience
    cliprange: float = DEFAULT_CLIPRANGE        # policy ratio clipped to 1 ± this
    cliprange_value: float = DEFAULT_CLIPRANGE_VALUE  # value moves at most this far from the old value
    unsup_coef: float = 0.0                     # weight of the pretraining (ptx) LM loss; 0 = off
    enable_ema: bool = False                    # keep an exponential moving average of the actor
    ema_decay: float = DEFAULT_EMA_DECAY
    enable_hybrid_engine: bool = False          # DeepSpeed hybrid engine for the actor (GPU)
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.kl_ctl not in KL_CONTROLLERS:
            raise ValueError(f"kl_ctl must be one of {KL_CONTROLLERS}, not {self.kl_ctl!r}")
        if self.temperature <= 0:
            raise ValueError("temperature must be positive (use a small value for near-greedy)")

    def kl_controller(self):
        if self.kl_ctl == "adaptive":
            return pm.AdaptiveKLController(self.init_kl_coef, self.target_kl, self.kl_horizon)
        return pm.FixedKLController(self.init_kl_coef)

    def updates_per_iteration(self) -> int:
        """Optimizer steps per iteration (per engine): mini-batches times PPO epochs."""
        samples = self.per_device_generation_batch_size * self.generation_batches
        return self.ppo_epochs * math.ceil(samples / self.per_device_training_batch_size)


#: What each history row holds, in words (the PPO chapter prints this table).
METRICS = {
    "reward": "mean reward-model score of the sampled responses (before KL penalty and clipping)",
    "truth": "mean ground-truth score of the same responses (the task's scorer; never seen by PPO)",
    "kl": "mean over responses of Σ_t (log π − log π_ref): the sampled estimate of KL(π‖π_ref)",
    "kl_coef": "β used for this iteration's rewards",
    "response_len": "mean response length in tokens, EOS included",
    "eos_fraction": "share of responses that ended with EOS (the rest hit max_answer_seq_len)",
    "policy_loss": "clipped surrogate loss, averaged over mini-batches",
    "value_loss": "clipped value loss, averaged over mini-batches",
    "clipfrac": "share of response tokens where the policy ratio was clipped",
    "value_clipfrac": "share of response tokens where the value was clipped",
    "approx_kl": "KL(π_old‖π) estimate between sampling and the update: the size of a PPO step",
    "explained_var": "1 − Var(returns − values)/Var(returns): how much of the return the critic predicts",
}


# --------------------------------------------------------------------------- engines

def build_eval_engine(model: torch.nn.Module, dtype: str, zero_stage: int = 0, offload: bool = False):
    """A frozen model as a DeepSpeed engine (no optimizer): the reference and the reward model.

    DeepSpeed casts it to ``dtype`` and, at ZeRO-3, partitions its parameters across ranks
    (with ``offload`` they live in CPU memory and are fetched layer by layer) — how
    DeepSpeed-Chat fits four models on a GPU. Without an optimizer, ZeRO-1/2 have nothing to
    partition, so stages below 3 run as stage 0.
    """
    import deepspeed

    from dschat_lib import config as ds_config_lib

    stage = 3 if zero_stage == 3 else 0
    config = ds_config_lib.ds_config(stage=stage, micro_batch_size=1, dtype=dtype,
                                     offload_param="cpu" if offload and stage == 3 else None,
                                     gradient_clipping=None)
    for param in model.parameters():
        param.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def hybrid_engine_config(max_out_tokens: int) -> dict:
    """DeepSpeed's hybrid-engine block: the actor switches to inference kernels for ``generate``
    and back to training for the update (GPU only; on CPU its ``generate`` fails)."""
    return {"hybrid_engine": {"enabled": True, "max_out_tokens": max_out_tokens,
                              "inference_tp_size": 1, "release_inference_cache": False,
                              "pin_parameters": True, "tp_gather_partition_size": 8}}


def build_actor_engine(model: torch.nn.Module, settings: TrainSettings, num_training_steps: int,
                       hybrid_engine_tokens: int | None = None, world_size: int | None = None):
    """The actor's engine: :func:`dschat_lib.engine.build_train_engine`, plus the hybrid-engine
    block when ``hybrid_engine_tokens`` is given."""
    extra = None if hybrid_engine_tokens is None else hybrid_engine_config(hybrid_engine_tokens)
    return build_train_engine(model, settings, num_training_steps, world_size, extra_config=extra)


@dataclass
class Engines:
    """The four models of step 3 (and the optional EMA copy of the actor)."""

    actor: object
    ref: object
    critic: object
    reward: object
    ema: torch.nn.Module | None = None
    actor_zero_stage: int = 0

    def destroy(self) -> None:
        for engine in (self.actor, self.ref, self.critic, self.reward):
            if engine is not None:
                engine.destroy()


def build_engines(actor_model, ref_model, critic_model, reward_model, settings: PPOSettings,
                  actor_settings: TrainSettings, critic_settings: TrainSettings,
                  num_iterations: int, offload_reference_model: bool = False,
                  world_size: int | None = None) -> Engines:
    """Wrap the four models in DeepSpeed engines.

    The learning-rate schedules run over ``num_iterations`` iterations' optimizer steps. The
    reference and reward engines run in the actor's precision; the reference uses ZeRO-3 when
    the actor does or when ``offload_reference_model`` asks to keep it in CPU memory.
    """
    steps = max(1, num_iterations * settings.updates_per_iteration())
    ema = copy.deepcopy(actor_model).float().eval() if settings.enable_ema else None
    if ema is not None:
        for param in ema.parameters():
            param.requires_grad_(False)
    actor = build_actor_engine(actor_model, actor_settings, steps,
                               settings.max_answer_seq_len if settings.enable_hybrid_engine else None,
                               world_size)
    critic = build_train_engine(critic_model, critic_settings, steps, world_size)
    ref_stage = 3 if (actor_settings.zero_stage == 3 or offload_reference_model) else 0
    ref = build_eval_engine(ref_model, actor_settings.dtype, ref_stage, offload_reference_model)
    reward = build_eval_engine(reward_model, critic_settings.dtype, critic_settings.zero_stage)
    return Engines(actor, ref, critic, reward, ema, actor_settings.zero_stage)


# --------------------------------------------------------------------------- experience

def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so a left-padded prompt starts at position 0 —
    what the models saw in training (OPT derives this itself; Llama-style models do not)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask(response: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 for every generated token up to and including the first EOS, 0 after it.

    ``generate`` fills finished rows with the pad token, but the mask is derived from EOS
    itself, so it is right even if a model ever emitted the pad id mid-response.
    """
    is_eos = (response == eos_token_id).long()
    ended_before = (is_eos.cumsum(-1) - is_eos) > 0
    return (~ended_before).long()


def _generation_module(engines: Engines):
    """The module that samples: the hybrid engine on GPU, else the actor's plain module."""
    actor = engines.actor
    hybrid = getattr(actor, "_config", None) is not None and actor._config.hybrid_engine.enabled
    if hybrid and torch.cuda.is_available():
        return actor
    return actor.module


@torch.no_grad()
def sample(engines: Engines, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokenizer,
           settings: PPOSettings) -> torch.Tensor:
    """``prompt + response`` token ids, padded to ``P + max_answer_seq_len`` with the pad id."""
    module = _generation_module(engines)
    was_training = engines.actor.module.training
    engines.actor.module.eval()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    output = module.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True,
                             temperature=settings.temperature, top_k=0, top_p=1.0,
                             max_new_tokens=settings.max_answer_seq_len,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             # ZeRO-3 ranks must run the same number of forward passes
                             synced_gpus=engines.actor_zero_stage == 3 and world > 1)
    engines.actor.module.train(was_training)
    full = prompt_ids.shape[1] + settings.max_answer_seq_len
    if output.shape[1] < full:       # every row finished early: pad to the fixed length
        padding = output.new_full((output.shape[0], full - output.shape[1]), tokenizer.pad_token_id)
        output = torch.cat([output, padding], dim=1)
    return output


def response_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_len: int, temperature: float = 1.0) -> torch.Tensor:
    """log π(token) of each response token: position t's logits predict token t+1."""
    logits = model(input_ids=sequences, attention_mask=attention_mask,
                   position_ids=position_ids(attention_mask)).logits
    return pm.token_logprobs(logits[:, prompt_len - 1:-1] / temperature, sequences[:, prompt_len:])


def response_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    prompt_len: int) -> torch.Tensor:
    """V(state before each response token): the critic's output one position earlier."""
    values = critic(input_ids=sequences, attention_mask=attention_mask,
                    position_ids=position_ids(attention_mask))["values"]
    return values[:, prompt_len - 1:-1].float()


def sequence_scores(reward_model, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The reward model's score of each whole sequence (read at its last real token)."""
    return reward_model(input_ids=sequences, attention_mask=attention_mask,
                        position_ids=position_ids(attention_mask))["rewards"].float()


class ScorerReward:
    """A reward computed from the decoded prompt and response texts instead of a reward model —
    e.g. the task's ground-truth scorer, scaled: the *oracle* a learned reward model only
    approximates. Put it in ``Engines.reward`` to see what PPO does with a perfect reward."""

    def __init__(self, scorer: Callable[[str, str], float], scale: float = 1.0):
        self.scorer, self.scale = scorer, scale

    def __call__(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        return torch.tensor([self.scale * self.scorer(p, r) for p, r in zip(prompts, responses)])

    def destroy(self) -> None:
        pass


@torch.no_grad()
def make_experience(engines: Engines, batch: dict, tokenizer, settings: PPOSettings,
                    with_critic: bool = True) -> dict:
    """Sample responses to a batch of prompts and record what PPO needs about them.

    Returns tensors ``sequences`` [B, P+A], ``attention_mask`` [B, P+A], ``mask`` [B, A]
    (response tokens), ``logprobs``/``ref_logprobs``/``values`` [B, A], ``scores`` [B], and
    the texts ``prompts``/``responses``. ``prompt_len`` is P.
    """
    device = engines.actor.device
    prompt_ids = batch["input_ids"].to(device)
    prompt_mask = batch["attention_mask"].to(device)
    prompt_len = prompt_ids.shape[1]
    sequences = sample(engines, prompt_ids, prompt_mask, tokenizer, settings)
    mask = response_mask(sequences[:, prompt_len:], tokenizer.eos_token_id)
    attention_mask = torch.cat([prompt_mask, mask], dim=1)
    for engine in (engines.actor, engines.critic):
        if engine is not None:
            engine.eval()
    experience = {
        "sequences": sequences, "attention_mask": attention_mask, "mask": mask,
        "logprobs": response_logprobs(engines.actor, sequences, attention_mask, prompt_len,
                                      settings.temperature),
        "ref_logprobs": response_logprobs(engines.ref, sequences, attention_mask, prompt_len,
                                          settings.temperature),
        "prompt_len": prompt_len,
        "prompts": list(batch.get("prompt", [])),
        "responses": tokenizer.batch_decode(sequences[:, prompt_len:] * mask
                                            + tokenizer.pad_token_id * (1 - mask),
                                            skip_special_tokens=True),
    }
    if isinstance(engines.reward, ScorerReward):
        experience["scores"] = engines.reward(experience["prompts"], experience["responses"]).to(device)
    else:
        experience["scores"] = sequence_scores(engines.reward, sequences, attention_mask)
    if with_critic and engines.critic is not None:
        experience["values"] = response_values(engines.critic, sequences, attention_mask, prompt_len)
    for engine in (engines.actor, engines.critic):
        if engine is not None:
            engine.train()
    return experience


def concat_experience(parts: Sequence[dict]) -> dict:
    """Several generation batches of experience as one (all share the prompt length)."""
    out = {}
    for key, value in parts[0].items():
        if torch.is_tensor(value):
            out[key] = torch.cat([p[key] for p in parts])
        elif isinstance(value, list):
            out[key] = [x for p in parts for x in p[key]]
        else:
            out[key] = value
    return out


def add_advantages(experience: dict, settings: PPOSettings, kl_coef: float) -> dict:
    """Per-token rewards (KL penalty + clipped score on the last token), then GAE."""
    mask = experience["mask"]
    rewards, kl = pm.kl_penalized_rewards(experience["logprobs"], experience["ref_logprobs"],
                                          experience["scores"], mask, kl_coef,
                                          settings.clip_reward_value)
    if settings.whiten_rewards:
        rewards = pm.masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = pm.gae(rewards, experience["values"], mask, settings.gamma, settings.lam)
    if settings.whiten_advantages:
        advantages = pm.masked_whiten(advantages, mask)
    return {**experience, "rewards": rewards, "kl": kl, "advantages": advantages, "returns": returns}


# --------------------------------------------------------------------------- the update

def _minibatch(experience: dict, index: torch.Tensor) -> dict:
    return {k: v[index] for k, v in experience.items() if torch.is_tensor(v)}


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, decay: float, zero_stage: int = 0) -> None:
    """``ema ← decay·ema + (1 − decay)·θ`` for every parameter (gathered first under ZeRO-3)."""
    from contextlib import nullcontext

    params = list(model.parameters())
    if zero_stage == 3:
        import deepspeed
        context = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    else:
        context = nullcontext()
    with context:
        source = dict(model.named_parameters())
        for name, param in ema.named_parameters():
            if name in source:
                param.mul_(decay).add_(source[name].detach().to(param.device, param.dtype),
                                       alpha=1 - decay)


def ppo_update(engines: Engines, experience: dict, settings: PPOSettings,
               ptx_batches: Iterator[dict] | None = None,
               generator: torch.Generator | None = None) -> dict[str, float]:
    """``ppo_epochs`` passes of clipped PPO over shuffled mini-batches of ``experience``.

    Per mini-batch: the actor takes one step on the clipped surrogate (plus ``unsup_coef`` ×
    the LM loss on a pretraining batch), the critic one step on the clipped value loss.
    Returns the mean of each loss and statistic over all mini-batches.
    """
    actor, critic = engines.actor, engines.critic
    prompt_len = experience["prompt_len"]
    n = experience["sequences"].shape[0]
    totals: dict[str, float] = {}
    count = 0
    for _ in range(settings.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, settings.per_device_training_batch_size):
            mb = _minibatch(experience, order[start:start + settings.per_device_training_batch_size])

            # Actor: maximise the clipped surrogate of the advantages.
            logprobs = response_logprobs(actor, mb["sequences"], mb["attention_mask"], prompt_len,
                                         settings.temperature)
            actor_loss, stats = pm.policy_loss(logprobs, mb["logprobs"], mb["advantages"],
                                               mb["mask"], settings.cliprange)
            if settings.unsup_coef > 0 and ptx_batches is not None:
                ptx = {k: v.to(actor.device) for k, v in next(ptx_batches).items()}
                ptx_loss = actor(**ptx).loss
                actor_loss = actor_loss + settings.unsup_coef * ptx_loss
                stats["ptx_loss"] = ptx_loss.item()
            actor.backward(actor_loss)
            actor.step()
            if engines.ema is not None:
                update_ema(engines.ema, actor.module, settings.ema_decay, engines.actor_zero_stage)

            # Critic: regress the returns, without straying far from the old values.
            values = response_values(critic, mb["sequences"], mb["attention_mask"], prompt_len)
            critic_loss, value_stats = pm.value_loss(values, mb["values"], mb["returns"],
                                                     mb["mask"], settings.cliprange_value)
            critic.backward(critic_loss)
            critic.step()

            row = {"policy_loss": actor_loss.item(), "value_loss": critic_loss.item(),
                   **stats, **value_stats}
            for key, value in row.items():
                totals[key] = totals.get(key, 0.0) + value
            count += 1
    return {key: value / count for key, value in totals.items()}


# --------------------------------------------------------------------------- the loop

def experience_metrics(experience: dict, eos_token_id: int,
                       scorer: Callable[[str, str], float] | None = None) -> dict:
    """Reward, truth, KL and length statistics of one batch of experience."""
    mask = experience["mask"].float()
    kl_per_response = ((experience["logprobs"] - experience["ref_logprobs"]) * mask).sum(-1)
    last = pm.last_token_index(experience["mask"])
    ended = experience["sequences"][:, experience["prompt_len"]:].gather(1, last[:, None]).squeeze(1)
    metrics = {"reward": experience["scores"].mean().item(),
               "kl": kl_per_response.mean().item(),
               "response_len": mask.sum(-1).mean().item(),
               "eos_fraction": (ended == eos_token_id).float().mean().item()}
    if scorer is not None and experience["prompts"]:
        truths = [scorer(p, r) for p, r in zip(experience["prompts"], experience["responses"])]
        metrics["truth"] = sum(truths) / len(truths)
    if "returns" in experience:
        returns, values = experience["returns"], experience["values"]
        variance = pm.masked_mean((returns - pm.masked_mean(returns, mask)) ** 2, mask)
        residual = pm.masked_mean((returns - values - pm.masked_mean(returns - values, mask)) ** 2, mask)
        metrics["explained_var"] = (1 - residual / variance.clamp(min=1e-8)).item()
    return metrics


def _mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    torch.distributed.all_reduce(values)
    values /= torch.distributed.get_world_size()
    return dict(zip(keys, values.tolist()))


def _cycle(loader: Iterable) -> Iterator:
    while True:
        yield from loader


def train_ppo(engines: Engines, tokenizer, prompt_loader: Iterable[dict], settings: PPOSettings,
              num_iterations: int, scorer: Callable[[str, str], float] | None = None,
              ptx_loader: Iterable[dict] | None = None, progress: bool = True,
              on_iteration: Callable[[dict], None] | None = None) -> list[dict]:
    """Run ``num_iterations`` PPO iterations; return one history row per iteration.

    ``prompt_loader`` yields step-3 prompt batches (it is cycled if shorter than needed);
    ``scorer(prompt, response)`` adds the ground-truth ``truth`` metric; ``ptx_loader`` yields
    step-1 batches for the unsupervised loss when ``settings.unsup_coef > 0``.
    """
    from tqdm.auto import tqdm

    controller = settings.kl_controller()
    prompts = _cycle(prompt_loader)
    ptx_batches = _cycle(ptx_loader) if ptx_loader is not None else None
    generator = torch.Generator().manual_seed(settings.seed)
    history = []
    for iteration in tqdm(range(num_iterations), desc="step 3 (PPO)", disable=not progress, leave=False):
        started = time.perf_counter()
        kl_coef = controller.kl_coef
        parts = [make_experience(engines, next(prompts), tokenizer, settings)
                 for _ in range(settings.generation_batches)]
        experience = add_advantages(concat_experience(parts), settings, kl_coef)
        generated = time.perf_counter()
        row = {"iteration": iteration, "kl_coef": kl_coef,
               **experience_metrics(experience, tokenizer.eos_token_id, scorer),
               **ppo_update(engines, experience, settings, ptx_batches, generator)}
        row["seconds"] = time.perf_counter() - started
        row["generation_seconds"] = generated - started
        row = _mean_over_ranks(row)
        controller.update(row["kl"], experience["sequences"].shape[0])
        history.append(row)
        log_metrics(engines.actor, {k: v for k, v in row.items() if k != "iteration"}, iteration,
                    prefix="PPO")
        if on_iteration is not None:
            on_iteration(row)
    return history


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate_policy(engines: Engines, tokenizer, prompt_batches: Sequence[dict],
                    settings: PPOSettings, scorer: Callable[[str, str], float] | None = None,
                    seed: int = 0, policy: torch.nn.Module | None = None) -> dict:
    """Sample responses to fixed prompts with a fixed seed and measure them: mean reward-model
    score, ground-truth score, KL to the reference (nats per response) and response length.

    ``policy`` evaluates another module (e.g. the EMA actor, or the reference itself for the
    SFT baseline) in the actor's place; the samples and the texts are returned too.
    """
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    original = engines.actor
    if policy is not None:
        engines.actor = _ModuleAsEngine(policy, (original or engines.ref).device)
    try:
        parts = [make_experience(engines, batch, tokenizer, settings, with_critic=False)
                 for batch in prompt_batches]
    finally:
        engines.actor = original
        torch.random.set_rng_state(state)
    experience = concat_experience(parts)
    metrics = experience_metrics(experience, tokenizer.eos_token_id, scorer)
    metrics["prompts"], metrics["responses"] = experience["prompts"], experience["responses"]
    metrics["scores"] = experience["scores"].tolist()
    return metrics


class _ModuleAsEngine(torch.nn.Module):
    """A plain module with the two engine attributes :func:`make_experience` uses."""

    def __init__(self, module: torch.nn.Module, device):
        super().__init__()
        self.module = module
        self.device = device

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


# --------------------------------------------------------------------------- benchmark

def benchmark_step(case: dict, steps: int = 5, warmup: int = 2) -> dict:
    """Time one PPO iteration at a benchmark case's shape (``make bench``).

    ``micro_batch_size`` prompts of ``seq_len // 2`` random tokens; the actor samples up to
    ``seq_len // 2`` tokens for each; then the experience passes, the advantages and one
    actor and one critic optimizer step on the whole batch. Actor and reference are built
    from ``arch``, critic and reward model from ``critic_arch`` (default: ``arch``), all four
    DeepSpeed engines at ``stage``/``dtype``. A sample is one prompt with its response; the
    row adds the share of the iteration spent making experience (sampling included).
    """
    from dschat_lib import benchmark, models, runtime
    from dschat_lib.tokenizer import SPECIAL_TOKENS, load_tokenizer

    device = runtime.device()
    runtime.init_distributed()
    baseline = benchmark.memory_start(device)
    tokenizer = load_tokenizer()
    critic_arch = case.get("critic_arch", case["arch"])
    prompt_len = case["seq_len"] // 2
    settings = PPOSettings(per_device_generation_batch_size=case["micro_batch_size"],
                           per_device_training_batch_size=case["micro_batch_size"],
                           max_answer_seq_len=case["seq_len"] - prompt_len)
    train = TrainSettings(per_device_train_batch_size=case["micro_batch_size"], learning_rate=1e-5,
                          lr_scheduler_type="constant", zero_stage=case.get("stage", 0), dtype=case["dtype"])

    def causal_lm():
        return models.build_causal_lm(case["arch"], vocab_size=case["vocab_size"], seed=0)

    def value_model():
        return models.RewardModel(models.create_hf_model(critic_arch, vocab_size=case["vocab_size"],
                                                         seed=0, head="none"))

    actor, critic = causal_lm(), value_model()
    actor_shape = benchmark.model_shape(actor)
    critic_shape = benchmark.model_shape(critic)
    engines = build_engines(actor, causal_lm(), critic, value_model(), settings, train, train,
                            num_iterations=steps + warmup + 1)
    generator = torch.Generator().manual_seed(0)
    # ids past the special tokens, so no prompt ends early or is mistaken for padding
    prompts = {"input_ids": torch.randint(len(SPECIAL_TOKENS), min(len(tokenizer), case["vocab_size"]),
                                          (case["micro_batch_size"], prompt_len), generator=generator)}
    prompts["attention_mask"] = torch.ones_like(prompts["input_ids"])
    experience_seconds = []

    def iteration() -> None:
        started = time.perf_counter()
        experience = add_advantages(make_experience(engines, prompts, tokenizer, settings),
                                    settings, settings.init_kl_coef)
        benchmark.synchronize(device)
        experience_seconds.append(time.perf_counter() - started)
        ppo_update(engines, experience, settings, generator=generator)

    try:
        seconds = benchmark.timed(iteration, steps, warmup, device)
        measured = experience_seconds[warmup:]
        peak_bytes = benchmark.memory_peak(device, baseline, iteration)
    finally:
        engines.destroy()
        runtime.teardown()
    row = benchmark.summarise({**case, "runner": f"deepspeed ZeRO-{case.get('stage', 0)}"}, actor_shape,
                              seconds, peak_bytes, benchmark.peak_tflops(case["dtype"], device),
                              flops_per_token=benchmark.ppo_flops_per_token(actor_shape, critic_shape,
                                                                            case["seq_len"]))
    return {**row, "critic_arch": critic_arch, "critic_num_params": critic_shape["num_params"],
            "prompt_len": prompt_len, "answer_len": settings.max_answer_seq_len,
            "experience_share": sum(measured) / sum(seconds),
            "sample": "a prompt and its sampled response"}


# --------------------------------------------------------------------------- command line

def _model_arguments(parser: argparse.ArgumentParser, role: str, lr: float) -> None:
    """Per-model engine flags (``--actor_*`` / ``--critic_*``), named like DeepSpeed-Chat's."""
    from dschat_lib.engine import add_train_arguments

    add_train_arguments(parser, prefix=f"{role}_", defaults=TrainSettings(learning_rate=lr))
    parser.add_argument(f"--{role}_dropout", type=float, default=0.0,
                        help=f"dropout of the {role} (0 by default: PPO compares log-probs of the "
                             "same tokens across forward passes, and dropout noise would look like "
                             "a policy change)")


def build_parser() -> argparse.ArgumentParser:
    """``python -m dschat_lib step3`` options, named like DeepSpeed-Chat's step-3 ``main.py``."""
    d = PPOSettings()
    parser = argparse.ArgumentParser(
        prog="python -m dschat_lib step3",
        description="Step 3: RLHF with PPO. The actor (from step 1) samples responses, the reward "
                    "model (from step 2) scores them, the critic (initialised from the reward model) "
                    "learns values; the reference (a frozen copy of the actor) anchors the KL penalty.")
    add = parser.add_argument
    add("--data_path", nargs="*", default=["shipped"], help="datasets, as in step 2; step 3 uses prompts only")
    add("--data_split", default="2,4,4", help="shares for steps 1,2,3; step 3 takes the third")
    add("--actor_model_name_or_path", required=True, help="the step-1 output directory")
    add("--critic_model_name_or_path", required=True,
        help="the step-2 output directory: the reward model, and the critic's starting point")
    add("--tokenizer_name_or_path", default=None, help="default: the actor directory's tokenizer")
    add("--per_device_generation_batch_size", type=int, default=d.per_device_generation_batch_size,
        help="prompts per generation batch, per rank")
    add("--per_device_training_batch_size", type=int, default=d.per_device_training_batch_size,
        help="experiences per PPO mini-batch, per rank")
    add("--generation_batches", type=int, default=d.generation_batches,
        help="generation batches of experience collected before each PPO update")
    add("--ppo_epochs", type=int, default=d.ppo_epochs, help="passes over each batch of experience")
    add("--max_prompt_seq_len", type=int, default=32, help="prompts are left-padded to this; longer ones are dropped")
    add("--max_answer_seq_len", type=int, default=d.max_answer_seq_len, help="most tokens generated per response")
    add("--num_train_epochs", type=int, default=1, help="passes over the step-3 prompts")
    add("--max_iterations", type=int, default=None,
        help="stop after this many PPO iterations (default: the full epochs)")
    add("--temperature", type=float, default=d.temperature, help="sampling temperature")
    add("--kl_ctl", choices=KL_CONTROLLERS, default=d.kl_ctl, help="fixed β, or β adapted to --target_kl")
    add("--init_kl_coef", type=float, default=d.init_kl_coef, help="β, the per-token KL penalty weight")
    add("--target_kl", type=float, default=d.target_kl, help="adaptive β: target KL in nats per response")
    add("--kl_horizon", type=int, default=d.kl_horizon, help="adaptive β: horizon in samples")
    add("--clip_reward_value", type=float, default=d.clip_reward_value, help="clip reward-model scores to ±this")
    add("--cliprange", type=float, default=d.cliprange, help="policy ratio clip ε")
    add("--cliprange_value", type=float, default=d.cliprange_value, help="value clip ε")
    add("--gamma", type=float, default=d.gamma, help="discount per token")
    add("--lam", type=float, default=d.lam, help="GAE λ")
    add("--whiten_rewards", action="store_true", help="scale per-token rewards to unit variance")
    add("--no_whiten_advantages", dest="whiten_advantages", action="store_false",
        help="use raw advantages (DeepSpeed-Chat's choice) instead of normalising them")
    add("--unsup_coef", type=float, default=d.unsup_coef,
        help="weight of the step-1 LM loss mixed into the actor loss (InstructGPT's PPO-ptx); 0 = off")
    add("--enable_ema", action="store_true", help="also keep and save an EMA of the actor")
    add("--ema_decay", type=float, default=d.ema_decay, help="EMA decay per actor step")
    add("--enable_hybrid_engine", action="store_true",
        help="DeepSpeed hybrid engine for the actor's generation (GPU; on CPU the module's generate is used)")
    add("--offload_reference_model", action="store_true",
        help="keep the reference model's parameters in CPU memory (ZeRO-3 parameter offload)")
    add("--per_device_eval_prompts", type=int, default=64,
        help="held-out prompts sampled before and after training for the summary")
    add("--output_dir", required=True, help="actor/, critic/ (and actor_ema/) and report.json go here")
    add("--disable_progress", action="store_true", help="no progress bar")
    # Per-run options shared by both trained models.
    add("--gradient_accumulation_steps", type=int, default=1, help="mini-batches per optimizer step")
    add("--lr_scheduler_type", default="constant",
        choices=("linear", "cosine", "constant", "constant_with_warmup"), help="learning-rate schedule")
    add("--num_warmup_steps", type=int, default=0, help="optimizer steps of linear warm-up")
    add("--only_optimize_lora", action="store_true", default=True,
        help="with LoRA, train only the LoRA weights (default)")
    add("--train_base_with_lora", dest="only_optimize_lora", action="store_false",
        help="with LoRA, also train the base weights")
    add("--offload", action="store_true", help="offload optimizer state (and at ZeRO-3 parameters) to CPU")
    add("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"), help="precision of all four engines")
    add("--gradient_clipping", type=float, default=1.0, help="clip the global gradient norm")
    add("--enable_tensorboard", action="store_true", help="log per-iteration metrics to TensorBoard/CSV")
    add("--tensorboard_path", default=None, help="default: OUTPUT_DIR/logs")
    add("--seed", type=int, default=d.seed, help="random seed")
    add("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; LOCAL_RANK is used instead")
    _model_arguments(parser, "actor", 1e-4)
    _model_arguments(parser, "critic", 5e-4)
    return parser


def settings_from_args(args) -> tuple[PPOSettings, TrainSettings, TrainSettings]:
    """The PPO settings and the actor's and critic's engine settings that ``args`` describe."""
    from dschat_lib.engine import settings_from_args as engine_settings_from_args

    ppo_fields = {f for f in PPOSettings.__dataclass_fields__}
    settings = PPOSettings(**{k: v for k, v in vars(args).items() if k in ppo_fields})

    def model_settings(role: str) -> TrainSettings:
        return engine_settings_from_args(args, prefix=f"{role}_", job_name=f"step3_{role}",
                                         micro_batch_size=args.per_device_training_batch_size,
                                         monitor=role == "actor")

    return settings, model_settings("actor"), model_settings("critic")


def save_models(engines: Engines, output_dir: str, tokenizer, actor_settings: TrainSettings,
                critic_settings: TrainSettings) -> None:
    """Save actor and critic in Hugging Face format (LoRA merged first), and the EMA actor."""
    from dschat_lib import lora as lora_lib
    from dschat_lib import models

    out = Path(output_dir)
    for name, engine, settings in (("actor", engines.actor, actor_settings),
                                   ("critic", engines.critic, critic_settings)):
        module = engine.module
        if settings.lora.enabled:
            module = lora_lib.merge(module, settings.zero_stage)
        models.save_hf_model(module, str(out / name), tokenizer)
    if engines.ema is not None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank == 0:
            ema = lora_lib.merge(engines.ema) if actor_settings.lora.enabled else engines.ema
            models.save_hf_model(ema, str(out / "actor_ema"), tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    """Run step 3 from the command line (also under ``deepspeed --num_gpus N``)."""
    from dschat_lib import data, models, runtime, tasks
    from dschat_lib.pipeline import distributed_loader, finish_rank, load_tokenizer_for, ptx_loader

    args = build_parser().parse_args(argv)
    runtime.init_distributed()
    runtime.seed_everything(args.seed)
    world = torch.distributed.get_world_size()
    settings, actor_settings, critic_settings = settings_from_args(args)
    tokenizer = load_tokenizer_for(args.actor_model_name_or_path, args.tokenizer_name_or_path)
    prompts = data.build_phase_data(3, tokenizer, args.data_path, data_split=args.data_split,
                                    seed=args.seed, max_prompt_len=args.max_prompt_seq_len)
    loader = distributed_loader(prompts.train, prompts.collator,
                                settings.per_device_generation_batch_size, args.seed)
    iterations = len(loader) * args.num_train_epochs // settings.generation_batches
    if args.max_iterations is not None:
        iterations = min(iterations, args.max_iterations)
    ptx_batches = None
    if settings.unsup_coef > 0:
        ptx_batches = ptx_loader(tokenizer, args.data_path, args.data_split,
                                 args.max_prompt_seq_len + settings.max_answer_seq_len,
                                 settings.per_device_training_batch_size, args.seed)
    # Scored against the task's ground truth when the prompts are the shipped task's.
    scorer = tasks.score if list(args.data_path) == [data.SHIPPED] else None

    def load_actor():
        return models.load_hf_model(args.actor_model_name_or_path, tokenizer, dropout=args.actor_dropout)

    def load_critic():
        return models.load_reward_model(args.critic_model_name_or_path, tokenizer, dropout=args.critic_dropout)

    engines = build_engines(load_actor(), load_actor(), load_critic(), load_critic(), settings,
                            actor_settings, critic_settings, iterations,
                            offload_reference_model=args.offload_reference_model, world_size=world)
    eval_items = prompts.eval.items[:args.per_device_eval_prompts]
    eval_batches = [prompts.collator(eval_items[i:i + settings.per_device_generation_batch_size])
                    for i in range(0, len(eval_items), settings.per_device_generation_batch_size)]
    keys = ("reward", "truth", "kl", "response_len")
    before = evaluate_policy(engines, tokenizer, eval_batches, settings, scorer, seed=args.seed,
                             policy=engines.ref.module)
    history = train_ppo(engines, tokenizer, loader, settings, iterations, scorer=scorer,
                        ptx_loader=ptx_batches, progress=not args.disable_progress)
    after = evaluate_policy(engines, tokenizer, eval_batches, settings, scorer, seed=args.seed)
    save_models(engines, args.output_dir, tokenizer, actor_settings, critic_settings)
    summary = {"name": "step3", "step": 3, "world_size": world, "iterations": iterations,
               "sft": {k: before[k] for k in keys if k in before},
               "rlhf": {k: after[k] for k in keys if k in after},
               "history": history, "settings": asdict(settings)}
    print("step 3 eval  " + "  ".join(f"{k}: SFT {before[k]:.3f} -> RLHF {after[k]:.3f}"
                                      for k in keys if k in before))
    finish_rank(args.output_dir, summary, engines.actor, engines.ref, engines.critic, engines.reward)
    return 0


# --------------------------------------------------------------------------- figures

#: The panels of :func:`plot_history`: title -> the metrics drawn in it.
PANELS = {"scores": ("reward", "truth"), "KL to reference (nats/response)": ("kl",),
          "response length (tokens)": ("response_len",), "losses": ("policy_loss", "value_loss"),
          "clip fractions": ("clipfrac", "value_clipfrac"), "critic": ("explained_var",)}


def plot_history(history: Sequence[dict], title: str = "PPO", window: int = 5):
    """One panel per group of :data:`PANELS`, per iteration, with moving averages."""
    import matplotlib.pyplot as plt

    from dschat_lib.plots import smooth

    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    steps = [row["iteration"] for row in history]
    for ax, (panel, keys) in zip(axes.flat, PANELS.items()):
        for key in keys:
            if key in history[0]:
                values = [row[key] for row in history]
                line, = ax.plot(steps, values, alpha=0.3)
                ax.plot(steps, smooth(values, window), color=line.get_color(), label=key)
        ax.set_title(panel)
        ax.set_xlabel("iteration")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    plt.close(fig)
    return fig


if __name__ == "__main__":
    import sys

    sys.exit(main())
