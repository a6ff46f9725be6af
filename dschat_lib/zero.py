"""``python -m dschat_lib.zero``: train one tiny model under several ZeRO configurations on
every rank, and report what each rank held, how fast it ran and what it computed.

Launched from a notebook with :func:`probe` (which runs ``deepspeed --num_gpus N --module
dschat_lib.zero ...``), so ZeRO-3 never runs inside the notebook's own kernel: once a ZeRO-3
engine has existed, later work in the same process runs slower. For the same reason the
configurations run in the order given, and :data:`CONFIGS` lists the ZeRO-3 ones last.

Every configuration starts from the same seed and sees the same batches, so their losses
can be compared step by step: ZeRO changes where state lives, not the arithmetic.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dschat_lib import config, memory, models, runtime, training


@dataclass(frozen=True)
class RunSpec:
    """One engine configuration: a ZeRO stage and where (if anywhere) state is offloaded."""
    stage: int
    offload_optimizer: str | None = None    # None, "cpu" or "nvme"
    offload_param: str | None = None        # None, "cpu" or "nvme" (ZeRO-3 only)

    @property
    def uses_nvme(self) -> bool:
        return "nvme" in (self.offload_optimizer, self.offload_param)


#: The configurations the ZeRO chapter compares, by name, in the order they run: ZeRO-3 last
#: (see the module doc), and ZeRO-1 before ZeRO-0. Measured on 2 CPU ranks: a ZeRO-0 engine
#: built first in a process trains about 20x slower than the same engine built after a ZeRO-1
#: one (a throwaway ZeRO-0 engine, plain forward/backward passes or warm-up all-reduces before
#: it do not help). The cause is not pinned down; this order keeps it out of the comparison.
CONFIGS: dict[str, RunSpec] = {
    "zero1": RunSpec(1),
    "zero0": RunSpec(0),
    "zero2": RunSpec(2),
    "zero2+cpu-opt": RunSpec(2, offload_optimizer="cpu"),
    "zero3": RunSpec(3),
    "zero3+cpu-opt": RunSpec(3, offload_optimizer="cpu"),
    "zero3+cpu-opt+cpu-param": RunSpec(3, offload_optimizer="cpu", offload_param="cpu"),
    "zero3+nvme-opt+nvme-param": RunSpec(3, offload_optimizer="nvme", offload_param="nvme"),
}
STAGE_CONFIGS = ("zero0", "zero1", "zero2", "zero3")

#: Steps not timed: the first steps allocate buffers and warm caches.
WARMUP_STEPS = 2

#: ZeRO-3 keeps parameters smaller than this threshold whole on every rank (DeepSpeed's default
#: is 1e5 elements, which is every tensor of a tiny model). 0 partitions all of them, so the
#: measurement shows what ZeRO-3 does to a large model's parameters.
PARAM_PERSISTENCE_THRESHOLD = 0


def engine_config(spec: RunSpec, micro_batch_size: int, learning_rate: float, dtype: str,
                  nvme_path: str | None = None, save_16bit: bool = False) -> dict[str, Any]:
    zero_extra: dict[str, Any] = {}
    if spec.stage == 3:
        zero_extra["stage3_param_persistence_threshold"] = PARAM_PERSISTENCE_THRESHOLD
        # engine.save_16bit_model gathers the partitions into one file only when asked to.
        zero_extra["stage3_gather_16bit_weights_on_model_save"] = save_16bit
    return config.ds_config(stage=spec.stage, micro_batch_size=micro_batch_size, dtype=dtype,
                            offload_optimizer=spec.offload_optimizer, offload_param=spec.offload_param,
                            nvme_path=nvme_path, optimizer=config.adamw(lr=learning_rate),
                            extra={"zero_optimization": zero_extra} if zero_extra else None)


def _build(spec: RunSpec, args: argparse.Namespace, nvme_path: str | None = None,
           save_16bit: bool = False):
    import deepspeed

    model = models.build_causal_lm(args.model, vocab_size=args.vocab_size, seed=args.seed)
    cfg = engine_config(spec, args.micro_batch_size, args.learning_rate, args.dtype, nvme_path,
                        save_16bit)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def _release(engine) -> None:
    """Free an engine but keep the process group: with several ranks, re-creating a gloo group
    in the same processes can fail to reconnect, so the ranks share one group to the end."""
    engine.destroy()
    gc.collect()


def _dir_bytes(path: str | os.PathLike) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _train(engine, args: argparse.Namespace, steps: int, seed_offset: int = 0,
           measure_at: int | None = None) -> tuple[list[float], dict[str, int], float]:
    """Train ``steps`` micro-batches; return losses, the state bytes measured between backward
    and step at micro-batch ``measure_at``, and tokens/s after warm-up."""
    batches = training.counting_batches(args.vocab_size, engine.train_micro_batch_size_per_gpu(),
                                        args.seq_len, seed=args.seed + seed_offset
                                        + 1000 * engine.global_rank)
    losses, state, timed_s, timed_tokens = [], {}, 0.0, 0
    for step in range(steps):
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        started = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        elapsed = time.perf_counter() - started
        if step == measure_at:          # not timed: reading the state is not training
            state = memory.engine_state_bytes(engine)
        started = time.perf_counter()
        engine.step()
        elapsed += time.perf_counter() - started
        losses.append(loss.item())
        if step >= WARMUP_STEPS:
            timed_s += elapsed
            timed_tokens += batch["input_ids"].numel()
    return losses, state, timed_tokens / timed_s if timed_s else float("nan")


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration and report what this rank held and how fast it ran."""
    spec = CONFIGS[name]
    nvme_path = None
    if spec.uses_nvme:
        nvme_path = str(Path(args.work_dir) / f"nvme-{name}")
        os.makedirs(nvme_path, exist_ok=True)
    started = time.perf_counter()
    engine = _build(spec, args, nvme_path)
    init_s = time.perf_counter() - started
    losses, state, tokens_per_s = _train(engine, args, args.steps, measure_at=args.steps - 1)
    result = {
        "name": name, **asdict(spec), "losses": losses, "state_bytes": state,
        "tokens_per_s": tokens_per_s, "init_s": init_s,
        "optimizer_wrapper": type(engine.optimizer).__name__,
        "basic_optimizer": type(engine.basic_optimizer).__name__,
        "local_param_numel": memory.local_parameter_numel(engine.module),
        "total_param_numel": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
        "nvme_bytes": _dir_bytes(nvme_path) if nvme_path else 0,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    _release(engine)
    if nvme_path:
        shutil.rmtree(nvme_path, ignore_errors=True)
    return result


# --------------------------------------------------------------------------- ZeRO-3 checkpoints

def _gathered_weights(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole (gathered from all ranks), as fp32 on CPU. Collective under ZeRO-3."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().float().cpu().clone() for n, p in params.items()}


def _gathered_fp32_master(engine) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master copy of every parameter, gathered. Collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).float().cpu().clone()
            for n, p in engine.module.named_parameters()}


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    missing = set(a) ^ set(b)
    if missing:
        raise KeyError(f"weights differ in names: {sorted(missing)[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def checkpoint_roundtrip(args: argparse.Namespace) -> dict[str, Any]:
    """ZeRO-3 checkpoints, each checked against the gathered weights:

    1. ``save_checkpoint`` after some steps, train on; a fresh engine that ``load_checkpoint``s
       must continue with the same losses (a real resume: weights and optimizer state);
    2. ``zero_to_fp32`` turns the partitioned checkpoint into one fp32 state dict, which must
       equal the optimizer's gathered fp32 master weights;
    3. ``save_16bit_model`` writes the gathered 16-bit weights, which must equal the module's.
    """
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    spec, tag = CONFIGS["zero3"], "resume"
    ckpt_dir = Path(args.work_dir) / "checkpoint"
    engine = _build(spec, args, save_16bit=True)
    _train(engine, args, args.checkpoint_steps)
    engine.save_checkpoint(str(ckpt_dir), tag=tag)
    saved_weights = _gathered_weights(engine)
    saved_master = _gathered_fp32_master(engine)
    engine.save_16bit_model(str(ckpt_dir), "model_16bit.bin")
    continued, _, _ = _train(engine, args, args.checkpoint_steps, seed_offset=1)
    _release(engine)

    fresh = _build(spec, args, save_16bit=True)
    fresh.load_checkpoint(str(ckpt_dir), tag=tag)
    loaded_weights = _gathered_weights(fresh)
    resumed, _, _ = _train(fresh, args, args.checkpoint_steps, seed_offset=1)
    _release(fresh)

    result = {"resume_loss_max_abs_diff": max(abs(a - b) for a, b in zip(continued, resumed)),
              "loaded_weights_max_abs_diff": _max_abs_diff(saved_weights, loaded_weights),
              "continued_losses": continued, "resumed_losses": resumed}
    deepspeed.comm.barrier()
    if deepspeed.comm.get_rank() == 0:
        consolidated = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
        # zero_to_fp32 writes tied weights once; compare the names both sides have.
        common = {k for k in saved_master if k in consolidated}
        result["zero_to_fp32_max_abs_diff"] = _max_abs_diff(
            {k: saved_master[k] for k in common}, {k: consolidated[k] for k in common})
        result["zero_to_fp32_numel"] = sum(consolidated[k].numel() for k in common)
        sixteen = torch.load(ckpt_dir / "model_16bit.bin", map_location="cpu", weights_only=True)
        common16 = {k for k in saved_weights if k in sixteen}
        result["save_16bit_max_abs_diff"] = _max_abs_diff(
            {k: saved_weights[k] for k in common16}, {k: sixteen[k] for k in common16})
        result["save_16bit_dtype"] = str(next(iter(sixteen.values())).dtype)
        result["checkpoint_files"] = sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*")
                                            if p.is_file())
        result["checkpoint_bytes"] = _dir_bytes(ckpt_dir)
    deepspeed.comm.barrier()
    return result


# --------------------------------------------------------------------------- both sides

def nvme_available() -> tuple[bool, str]:
    """Whether DeepSpeed's async_io op (NVMe offload) can be loaded here, and why not if not.

    Loading JIT-builds the op the first time (about 150 s on 2 cores; cached afterwards under
    ~/.cache/torch_extensions). It compiles against libaio (Debian's libaio-dev)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    builder = AsyncIOBuilder()
    try:
        # Try the op itself first: DeepSpeed's compatibility probe compiles a test program and
        # has been seen to answer "no" under heavy load while the cached op loads fine.
        builder.load(verbose=False)
        return True, "async_io loaded"
    except Exception as error:  # a failed build raises many types; report, never hide it
        hint = "" if builder.is_compatible(verbose=False) else " (libaio not found: install libaio-dev)"
        return False, f"async_io could not be built or loaded{hint}: {type(error).__name__}: {error}"


def build_ops() -> None:
    """JIT-build (or load from the cache) the DeepSpeed ops the offload runs use: ``cpu_adam``
    (ZeRO-Offload's optimizer, ~40 s on 2 cores) and ``async_io`` (NVMe, ~150 s). ``make setup``
    runs this, so the notebooks do not pay for the builds inside their time budget. A failure
    is printed, not raised: only the NVMe demonstration depends on async_io."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    for name, load in (("cpu_adam", lambda: CPUAdamBuilder().load(verbose=False)),
                       ("async_io", lambda: nvme_available())):
        started = time.perf_counter()
        try:
            outcome = load()
            message = outcome[1] if isinstance(outcome, tuple) else "loaded"
        except Exception as error:  # report and go on; the notebook says what it skips
            message = f"failed: {type(error).__name__}: {error}"
        print(f"{name}: {message} ({time.perf_counter() - started:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(STAGE_CONFIGS),
                        help=f"comma-separated names from {list(CONFIGS)}")
    parser.add_argument("--checkpoint", action="store_true", help="also run the ZeRO-3 checkpoint checks")
    parser.add_argument("--model", default="cpu-tiny")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--checkpoint-steps", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="scratch space (NVMe files, checkpoints)")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    args.work_dir = args.work_dir or os.environ.get(runtime.RESULT_DIR_ENV, ".")

    import deepspeed

    runtime.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    runs = [run_config(name, args) for name in args.configs.split(",") if name]
    result = {"rank": rank, "world_size": world, "runs": runs}
    if args.checkpoint:
        result["checkpoint"] = checkpoint_roundtrip(args)
    runtime.write_rank_result(result)
    runtime.teardown()
    return result


def probe(configs: list[str], num_ranks: int = 2, checkpoint: bool = False, **options: Any) -> list[dict]:
    """Run ``configs`` on ``num_ranks`` ranks under the deepspeed launcher; one dict per rank.

    ``options`` become command-line flags (``steps=8`` -> ``--steps 8``)."""
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise KeyError(f"unknown configurations {sorted(unknown)}; known: {list(CONFIGS)}")
    args = ["--configs", ",".join(configs)] + (["--checkpoint"] if checkpoint else [])
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return runtime.launch("dschat_lib.zero", args, num_ranks=num_ranks)


def runs_frame(rank_results: list[dict]) -> "Any":
    """One row per (configuration, rank): sizes, memory by category, speed."""
    import pandas as pd

    rows = []
    for result in rank_results:
        for run in result["runs"]:
            row = {"config": run["name"], "ranks": result["world_size"], "rank": result["rank"],
                   "wrapper": run["optimizer_wrapper"], "local_params": run["local_param_numel"],
                   **{f"{k}_bytes": v for k, v in run["state_bytes"].items()},
                   "nvme_bytes": run["nvme_bytes"], "tokens_per_s": run["tokens_per_s"],
                   "final_loss": run["losses"][-1]}
            rows.append(row)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
