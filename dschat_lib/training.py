"""The smallest honest DeepSpeed training loop, and a synthetic batch stream to feed it.

``engine(...)`` → ``engine.backward(loss)`` → ``engine.step()`` is the whole contract:
DeepSpeed decides inside ``backward`` and ``step`` how gradients are reduced and partitioned
(ZeRO), scaled (fp16), accumulated and clipped. The step-specific trainers (SFT, reward, PPO)
build on this same pattern; this module is what the introduction and the systems chapters use.
"""

from __future__ import annotations

import time
from typing import Iterable, Iterator

import torch
from tqdm.auto import tqdm

from dschat_lib.precision import current_loss_scale


def counting_batches(vocab_size: int, micro_batch_size: int, seq_len: int, seed: int = 0,
                     stride_choices: tuple[int, ...] = (1, 2, 3)) -> Iterator[dict[str, torch.Tensor]]:
    """Endless batches of arithmetic token sequences (start, start+k, start+2k, ... mod vocab).

    The next token is determined by the previous two, so a model that learns gets its loss
    well below ln(vocab_size), the loss of a uniform guess. Deterministic for a given seed,
    which lets the systems chapters feed identical batches to differently configured engines.
    """
    generator = torch.Generator().manual_seed(seed)
    positions = torch.arange(seq_len)
    strides = torch.tensor(stride_choices)
    while True:
        start = torch.randint(0, vocab_size, (micro_batch_size, 1), generator=generator)
        stride = strides[torch.randint(0, len(strides), (micro_batch_size, 1), generator=generator)]
        input_ids = (start + stride * positions) % vocab_size
        yield {"input_ids": input_ids, "labels": input_ids.clone()}


def run_steps(engine, batches: Iterable[dict[str, torch.Tensor]], num_steps: int,
              desc: str = "train", progress: bool = True) -> list[dict]:
    """Train ``engine`` for ``num_steps`` micro-batches; return one history row per micro-batch.

    Each row has ``step`` (micro-batch index), ``loss``, ``lr``, ``seconds`` and ``tokens``,
    plus ``loss_scale`` and ``skipped`` (DeepSpeed's running count of skipped optimizer steps)
    when the engine runs in fp16.
    """
    history = []
    batches = iter(batches)
    device = engine.device
    for step in tqdm(range(num_steps), desc=desc, disable=not progress, leave=False):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        started = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        row = {"step": step, "loss": loss.item(), "lr": engine.get_lr()[0],
               "seconds": time.perf_counter() - started, "tokens": int(batch["input_ids"].numel())}
        if engine.fp16_enabled():
            row["loss_scale"] = current_loss_scale(engine.optimizer)
            row["skipped"] = int(engine.skipped_steps)
        history.append(row)
    return history


def fit(engine, loader: Iterable[dict[str, torch.Tensor]], loss_fn, num_epochs: int = 1,
        max_micro_steps: int | None = None, evaluate=None, eval_every: int = 0,
        desc: str = "train", progress: bool = True, log=None) -> list[dict]:
    """The training loop of steps 1 and 2: epochs over ``loader``, one history row per micro-batch.

    ``loss_fn(engine, batch) -> (loss, metrics)`` computes the step's loss (SFT: the LM loss;
    reward model: the pairwise loss) and any extra scalars to log. ``evaluate()`` — if given —
    runs every ``eval_every`` optimizer steps and at the end; its dict is merged into that row.
    ``log(engine, metrics, step)`` receives every row (e.g. :func:`dschat_lib.engine.log_metrics`).
    Gradient accumulation is DeepSpeed's: ``engine.step()`` is called every micro-batch and
    updates the weights only at accumulation boundaries.
    """
    history: list[dict] = []
    device = engine.device
    total = max_micro_steps if max_micro_steps is not None else num_epochs * len(loader)
    bar = tqdm(total=total, desc=desc, disable=not progress, leave=False)
    micro_step = 0
    evaluated_last = False
    for epoch in range(num_epochs):
        for batch in loader:
            if max_micro_steps is not None and micro_step >= max_micro_steps:
                break
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            started = time.perf_counter()
            loss, metrics = loss_fn(engine, batch)
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            row = {"micro_step": micro_step, "step": engine.global_steps, "epoch": epoch,
                   "loss": loss.item(), "lr": engine.get_lr()[0],
                   "seconds": time.perf_counter() - started, **metrics}
            evaluated_last = bool(evaluate is not None and boundary and eval_every
                                  and engine.global_steps % eval_every == 0)
            if evaluated_last:
                row.update(evaluate())
            history.append(row)
            if log is not None:
                log(engine, {k: v for k, v in row.items() if isinstance(v, (int, float))}, micro_step)
            micro_step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{row['loss']:.3f}")
    bar.close()
    if evaluate is not None and history and not evaluated_last:
        history[-1].update(evaluate())
    return history
