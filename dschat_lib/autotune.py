"""Tuning a DeepSpeed config by measurement: the out-of-memory ladder and a small autotuner.

Two procedures, both built on :func:`run_trial`, which trains a few steps with a real engine
and measures throughput and peak memory:

- :func:`climb_ladder` walks the out-of-memory ladder — the order in which to give up speed
  for memory: micro-batch 1 (with gradient accumulation), gradient checkpointing, ZeRO-2,
  optimizer offload, ZeRO-3, parameter offload, 16-bit precision, NVMe — measuring every rung
  and reporting the first one that fits a memory budget.
- :func:`sweep` searches ZeRO stage × micro-batch × gradient checkpointing. Before running a
  configuration it asks whether it can fit: DeepSpeed's own estimators
  (``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs``) for
  the model states, and a straight-line extrapolation in micro-batch size from the
  configurations of the same group already measured, for activations — the split DeepSpeed's
  autotuner makes too (instantiation memory per stage plus activation memory per sample).
  It picks the fastest configuration whose *measured* peak fits and writes its ds_config.

Memory is measured as tensor bytes, the quantity a GPU's ``max_memory_allocated`` reports:
on CUDA with the allocator's own counters; on CPU as the live tensor storage the engine holds
plus the peak of the allocations the PyTorch profiler sees during one step. On a CPU, host
and "device" are the same memory, so offloading moves bytes without shrinking the total; the
ladder therefore also reports DeepSpeed's estimate of what would stay on the device.

Run as a script (``deepspeed --autotuning tune dschat_lib/autotune.py --deepspeed_config
CFG``) this file is also the training program DeepSpeed's own autotuner launches.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from dschat_lib import config as ds_config_lib
from dschat_lib import runtime

MIB = 2**20

#: DeepSpeed's estimators multiply host-side memory by this buffer factor; it is their default.
ESTIMATOR_BUFFER_FACTOR = 1.5

#: ZeRO bucket sizes (elements). DeepSpeed's defaults (5e8) are sized for billion-parameter
#: models: ZeRO-2 allocates a gradient bucket of that many elements, about 1 GB in 16-bit,
#: even for a one-million-parameter model. We size the buckets to the model instead, as the
#: Hugging Face integration's "auto" values do (hidden_size² for the reduce bucket), with a
#: floor so tiny models still bucket a few layers at a time.
MIN_BUCKET_ELEMENTS = 2**18


def bucket_sizes(num_params: int, hidden_size: int | None = None) -> dict:
    """ZeRO bucket and prefetch sizes proportional to the model (see MIN_BUCKET_ELEMENTS)."""
    reduce_bucket = max(MIN_BUCKET_ELEMENTS, (hidden_size or 0) ** 2, num_params // 8)
    return {"reduce_bucket_size": int(reduce_bucket), "allgather_bucket_size": int(reduce_bucket),
            "stage3_prefetch_bucket_size": int(reduce_bucket),
            "stage3_param_persistence_threshold": int(hidden_size or 0) * 10}


# --------------------------------------------------------------------------- one configuration

@dataclass(frozen=True)
class Trial:
    """One point of the search space; :meth:`ds_config` turns it into a DeepSpeed config."""
    stage: int = 0
    micro_batch_size: int = 1
    gradient_checkpointing: bool = False
    gradient_accumulation_steps: int = 1
    dtype: str = "bf16"
    offload_optimizer: str | None = None
    offload_param: str | None = None
    nvme_path: str | None = None

    @property
    def label(self) -> str:
        parts = [f"z{self.stage}", f"mb{self.micro_batch_size}"]
        if self.gradient_accumulation_steps > 1:
            parts.append(f"gas{self.gradient_accumulation_steps}")
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.offload_optimizer:
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param:
            parts.append(f"param->{self.offload_param}")
        parts.append(self.dtype)
        return " ".join(parts)

    @property
    def samples_per_step(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps

    def ds_config(self, num_params: int, hidden_size: int | None = None) -> dict:
        extra: dict = {"zero_allow_untested_optimizer": True,
                       # Offloading with a torch optimizer (the same one every trial uses, so
                       # trials compare like with like) instead of DeepSpeedCPUAdam.
                       "zero_force_ds_cpu_optimizer": False}
        if self.stage > 0:
            sizes = bucket_sizes(num_params, hidden_size)
            if self.stage < 3:
                sizes = {k: v for k, v in sizes.items() if not k.startswith("stage3")}
            elif self.offload_param == "nvme":
                sizes.pop("stage3_prefetch_bucket_size")  # ds_config sets 0 for NVMe (field notes)
            extra["zero_optimization"] = sizes
        return ds_config_lib.ds_config(
            stage=self.stage, micro_batch_size=self.micro_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps, dtype=self.dtype,
            offload_optimizer=self.offload_optimizer, offload_param=self.offload_param,
            nvme_path=self.nvme_path, extra=extra)


def model_state_estimate(num_params: int, largest_layer_params: int, stage: int,
                         world_size: int = 1, offload_optimizer: bool = False,
                         offload_param: bool = False) -> dict[str, int]:
    """DeepSpeed's estimate of model-state bytes per device and per host, for a stage.

    Stages 0 and 1 have no estimator in DeepSpeed. Stage 0 partitions nothing, which is the
    ZeRO-2 estimate on one device; stage 1 keeps full 16-bit gradients on every device, so
    the ZeRO-2 estimate is a lower bound for it. (The estimators count 16-bit mixed precision:
    2 bytes of 16-bit weights plus 18 of gradients, fp32 master and Adam moments per
    parameter.)
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if stage == 3:
        host, device, _ = estimate_zero3_model_states_mem_needs(
            num_params, largest_layer_params, num_gpus_per_node=world_size,
            cpu_offload=offload_optimizer or offload_param, cpu_offload_params=offload_param,
            zero_init=True, additional_buffer_factor=ESTIMATOR_BUFFER_FACTOR)
    else:
        gpus = 1 if stage == 0 else world_size
        host, device = estimate_zero2_model_states_mem_needs(
            num_params, num_gpus_per_node=gpus, cpu_offload=offload_optimizer,
            additional_buffer_factor=ESTIMATOR_BUFFER_FACTOR)
    return {"device_bytes": int(device), "host_bytes": int(host)}


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(total parameters, parameters of the largest single module) — what the estimators take.

    The same counts as DeepSpeed's ``model_to_params``, but shared (tied) weights are
    recognised by identity rather than by storage address, so it also works on a model built
    on the ``meta`` device, where every tensor's address is 0.
    """
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


# --------------------------------------------------------------------------- measuring

def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (CPU), or allocated (CUDA)."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            storage = obj.untyped_storage()
        except Exception:  # noqa: BLE001 — some tensor subclasses have no storage
            continue
        pointer = storage.data_ptr()
        if pointer and pointer not in seen:
            seen.add(pointer)
            total += storage.nbytes()
    return total


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's C++ side writes start/stop lines straight to file descriptor 2, past
    Python's ``sys.stderr``; point that descriptor at /dev/null for the duration."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def transient_peak_bytes(step: Callable[[], None]) -> int:
    """Run ``step`` under the PyTorch profiler; the highest running total of the bytes it
    allocated and freed on the CPU. (CPU tensors have no allocator peak counter to read.)"""
    from torch.profiler import ProfilerActivity, profile

    with _native_stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    running = peak = 0
    for event in events:
        running += event.nbytes()
        peak = max(peak, running)
    return peak


def _micro_step(engine, batches: Iterator[dict]) -> None:
    batch = {k: v.to(engine.device) for k, v in next(batches).items()}
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()      # an optimizer step only at the end of a gradient-accumulation cycle


def _optimizer_step(engine, batches: Iterator[dict], accumulation: int) -> None:
    for _ in range(accumulation):
        _micro_step(engine, batches)


def run_trial(trial: Trial, build_model: Callable[[], torch.nn.Module],
              batches: Callable[[int], Iterator[dict]], steps: int = 3, warmup: int = 1,
              learning_rate: float = 1e-3) -> dict:
    """Train ``steps`` optimizer steps of ``trial`` with a fresh engine; measure and tear down.

    ``build_model()`` returns a new model; ``batches(micro_batch_size)`` an iterator of
    batches. Returns the trial's fields plus ``samples_per_s`` (median over the timed steps,
    robust to a neighbour's burst of work on a shared machine), ``step_s``, ``state_bytes``
    (what the engine keeps between steps: weights, gradients, optimizer state, buffers) and
    ``peak_bytes`` (the most tensor memory alive at once during a step).
    """
    import deepspeed

    with contextlib.redirect_stdout(io.StringIO()):   # DeepSpeed's "op built successfully" lines
        runtime.init_distributed()
    baseline = live_tensor_bytes()
    model = build_model()
    if trial.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    num_params, _largest = parameter_counts(model)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    with contextlib.redirect_stdout(io.StringIO()):
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                          config=trial.ds_config(num_params, hidden))
    stream = batches(trial.micro_batch_size)
    cuda = engine.device.type == "cuda"
    try:
        for _ in range(warmup):
            _optimizer_step(engine, stream, trial.gradient_accumulation_steps)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(steps):
            started = time.perf_counter()
            _optimizer_step(engine, stream, trial.gradient_accumulation_steps)
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
        if cuda:
            peak = torch.cuda.max_memory_allocated() - baseline
            state = torch.cuda.memory_allocated() - baseline
        else:
            state = live_tensor_bytes() - baseline
            # Profile only the last micro-step of an accumulation cycle (the profiler slows
            # every op): it starts with every gradient already accumulated and ends with the
            # optimizer step, so its start plus its own peak is the cycle's peak.
            _optimizer_step(engine, stream, trial.gradient_accumulation_steps - 1)
            peak = live_tensor_bytes() - baseline + transient_peak_bytes(lambda: _micro_step(engine, stream))
    finally:
        runtime.teardown(engine)
        del engine, optimizer, model
        gc.collect()
    step_s = statistics.median(seconds)
    return {**asdict(trial), "label": trial.label, "samples_per_s": trial.samples_per_step / step_s,
            "step_s": step_s, "state_bytes": int(state), "peak_bytes": int(peak)}


# --------------------------------------------------------------------------- the OOM ladder

#: The ladder, rung by rung: a name, what it changes, and why it is in this place — each rung
#: costs more speed than the one before it, so you stop at the first that fits.
LADDER = (
    ("start", "the configuration that ran out of memory", {}),
    ("micro-batch 1", "shrink the micro-batch, keep the global batch with gradient accumulation",
     {"micro_batch_size": 1, "gradient_accumulation_steps": None}),
    ("gradient checkpointing", "keep one activation per layer, recompute the rest in backward",
     {"gradient_checkpointing": True}),
    ("ZeRO-2", "partition gradients and optimizer state across data-parallel ranks", {"stage": 2}),
    ("optimizer offload", "keep fp32 master weights and Adam moments in host memory",
     {"offload_optimizer": "cpu"}),
    ("ZeRO-3", "partition the weights too, gathering each layer when it runs", {"stage": 3}),
    ("parameter offload", "keep the partitioned weights in host memory", {"offload_param": "cpu"}),
    ("16-bit", "compute and store weights and activations in bf16/fp16", {"dtype": "half"}),
    ("NVMe", "move offloaded weights and optimizer state on to an NVMe disk",
     {"offload_optimizer": "nvme", "offload_param": "nvme"}),
)


def ladder_trials(start: Trial, half_dtype: str = "bf16", nvme_path: str | None = None) -> list[tuple[str, str, Trial]]:
    """The cumulative configurations of :data:`LADDER`, starting from ``start`` (usually fp32,
    ZeRO-0, a large micro-batch). The NVMe rung is left out when ``nvme_path`` is None."""
    rungs, trial = [], start
    for name, meaning, change in LADDER:
        change = dict(change)
        if name == "NVMe":
            if nvme_path is None:
                continue
            change["nvme_path"] = nvme_path
        if change.get("gradient_accumulation_steps", 0) is None:
            change["gradient_accumulation_steps"] = start.samples_per_step
        if change.get("dtype") == "half":
            change["dtype"] = half_dtype
        trial = replace(trial, **change)
        rungs.append((name, meaning, trial))
    return rungs


def climb_ladder(start: Trial, build_model: Callable[[], torch.nn.Module],
                 batches: Callable[[int], Iterator[dict]], budget_bytes: int,
                 world_size: int = 1, half_dtype: str = "bf16", nvme_path: str | None = None,
                 steps: int = 2, progress: Callable[[str], None] | None = print) -> list[dict]:
    """Measure every rung; each row says whether the rung fits ``budget_bytes`` of device memory.

    Device memory for a rung = DeepSpeed's estimate of the model states left on the device
    (for ``world_size`` data-parallel ranks) + the measured activation/transient peak of a
    step. On a GPU the measured peak could be used directly; on a CPU the offloaded bytes sit
    in the same memory, so the estimate is what tells the rungs apart there.
    """
    probe = build_model()
    num_params, largest = parameter_counts(probe)
    del probe
    rows, first_fit = [], None
    for index, (name, meaning, trial) in enumerate(ladder_trials(start, half_dtype, nvme_path)):
        if progress:
            progress(f"rung {index}: {name} ({trial.label})")
        row = run_trial(trial, build_model, batches, steps=steps)
        estimate = model_state_estimate(num_params, largest, trial.stage, world_size,
                                        offload_optimizer=bool(trial.offload_optimizer),
                                        offload_param=bool(trial.offload_param))
        transient = max(0, row["peak_bytes"] - row["state_bytes"])
        device = estimate["device_bytes"] + transient
        fits = device <= budget_bytes
        if fits and first_fit is None:
            first_fit = index
        rows.append({"rung": index, "name": name, "meaning": meaning, **row,
                     "estimated_device_state_bytes": estimate["device_bytes"],
                     "estimated_host_state_bytes": estimate["host_bytes"],
                     "transient_bytes": transient, "device_bytes": device, "fits": fits,
                     "first_fit": False})
    if first_fit is not None:
        rows[first_fit]["first_fit"] = True
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["slowdown_vs_start"] = base / row["samples_per_s"]
    return rows


# --------------------------------------------------------------------------- the sweep

@dataclass
class SweepResult:
    rows: list[dict] = field(default_factory=list)
    best: dict | None = None
    default: dict | None = None

    @property
    def speedup_over_default(self) -> float:
        return self.best["samples_per_s"] / self.default["samples_per_s"]


def sweep(build_model: Callable[[], torch.nn.Module], batches: Callable[[int], Iterator[dict]],
          budget_bytes: int, stages=(0, 2, 3), micro_batch_sizes=(4, 8, 16, 32),
          checkpointing=(False, True), dtype: str = "bf16", default: Trial | None = None,
          steps: int = 3, progress: Callable[[str], None] | None = print) -> SweepResult:
    """Search stage × micro-batch × checkpointing on one rank; return every row and the best.

    Groups (stage, checkpointing) run in order of increasing micro-batch size. A configuration
    is skipped without running when DeepSpeed's estimate of its model states alone exceeds the
    budget, or when the straight line through the two largest micro-batches already measured
    in its group predicts a peak over the budget; a group stops after its first measured
    configuration over budget (a larger micro-batch only needs more). ZeRO-3 groups run last:
    once a ZeRO-3 engine has existed, later engines in the same process can run slower.
    ``default`` (DeepSpeed's defaults: ZeRO-0, micro-batch 1) is measured too, as the baseline.
    """
    probe = build_model()
    num_params, largest = parameter_counts(probe)
    del probe
    result = SweepResult()
    default = default or Trial(dtype=dtype)
    if progress:
        progress(f"default: {default.label}")
    result.default = {**run_trial(default, build_model, batches, steps=steps), "status": "baseline"}

    for stage in sorted(stages, key=lambda s: (s == 3, s)):
        estimate = model_state_estimate(num_params, largest, stage)["device_bytes"]
        for ckpt in checkpointing:
            measured: list[tuple[int, int]] = []   # (micro-batch, peak bytes) in this group
            stop = False
            for mb in sorted(micro_batch_sizes):
                trial = Trial(stage=stage, micro_batch_size=mb, gradient_checkpointing=ckpt, dtype=dtype)
                row = {**asdict(trial), "label": trial.label, "estimated_state_bytes": estimate}
                if estimate > budget_bytes:
                    row.update(status="skipped: DeepSpeed's estimate of model states exceeds the budget")
                elif stop:
                    row.update(status="skipped: a smaller micro-batch was already over budget")
                elif len(measured) >= 2 and (predicted := _extrapolate(measured, mb)) > budget_bytes:
                    row.update(status="skipped: predicted peak over budget", predicted_bytes=predicted)
                else:
                    if progress:
                        progress(f"run: {trial.label}")
                    row.update(run_trial(trial, build_model, batches, steps=steps))
                    measured.append((mb, row["peak_bytes"]))
                    if row["peak_bytes"] > budget_bytes:
                        row["status"] = "ran: over budget"
                        stop = True
                    else:
                        row["status"] = "ran: fits"
                result.rows.append(row)
    fitting = [r for r in result.rows if r["status"] == "ran: fits"]
    if default_fits := result.default["peak_bytes"] <= budget_bytes:
        fitting.append(result.default)
    if not fitting:
        raise RuntimeError(f"no configuration fits {budget_bytes / MIB:.0f} MiB; raise the budget "
                           "or climb the out-of-memory ladder")
    result.best = max(fitting, key=lambda r: r["samples_per_s"])
    result.default["fits"] = default_fits
    return result


def _extrapolate(measured: list[tuple[int, int]], micro_batch_size: int) -> int:
    """Peak bytes at ``micro_batch_size`` on the line through the last two measured points:
    model states are the intercept, activations per sample the slope."""
    (x0, y0), (x1, y1) = measured[-2], measured[-1]
    slope = (y1 - y0) / (x1 - x0)
    return int(y1 + slope * (micro_batch_size - x1))


def write_ds_config(row: dict, path: str | Path, num_params: int, hidden_size: int | None = None) -> Path:
    """Write the ds_config of a sweep/ladder row (its Trial fields) as JSON; return the path."""
    names = Trial.__dataclass_fields__
    trial = Trial(**{k: v for k, v in row.items() if k in names})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trial.ds_config(num_params, hidden_size), indent=2) + "\n")
    return path


# --------------------------------------------------------------------------- DeepSpeed's autotuner

#: The fields of DeepSpeed's ``autotuning`` config block we set (see deepspeed/autotuning/
#: constants.py): fast mode tunes micro-batch size per ZeRO stage; a few profiled steps each.
AUTOTUNER_BLOCK = {"enabled": True, "fast": True, "metric": "throughput", "start_profile_step": 2,
                   "end_profile_step": 4, "num_tuning_micro_batch_sizes": 3,
                   "max_train_micro_batch_size_per_gpu": 32, "tuner_early_stopping": 3,
                   "tuner_num_trials": 8}


#: Log lines of the autotuner that say what it decided.
AUTOTUNER_DECISION_LINES = ("might be runable", "not runable", "No need to tune", "tuning_micro_batch_sizes =",
                            "calculated_max_micro_batch_size", "is the optimal setup")


def autotuner_config(work_dir: str | Path, dtype: str = "bf16") -> dict:
    """A ds_config that asks DeepSpeed's autotuner to tune micro-batch size and ZeRO stage."""
    work_dir = Path(work_dir)
    cfg = ds_config_lib.ds_config(stage=0, micro_batch_size=1, dtype=dtype,
                                  extra={"zero_allow_untested_optimizer": True})
    # "auto" lets the autotuner choose; a fixed train_batch_size would pin the micro-batch.
    cfg["train_micro_batch_size_per_gpu"] = "auto"
    cfg.pop("train_batch_size", None)
    cfg["autotuning"] = {**AUTOTUNER_BLOCK, "results_dir": str(work_dir / "results"),
                         "exps_dir": str(work_dir / "exps")}
    return cfg


def run_deepspeed_autotuner(work_dir: str | Path, model_args: dict, dtype: str = "bf16",
                            timeout: float = 900) -> dict:
    """Run ``deepspeed --autotuning tune`` on this file's training program; summarise.

    Returns ``{"best": {stage, micro_batch_size, throughput}, "experiments": [...],
    "seconds", "command"}``. Throughput is DeepSpeed's own metric (samples/s over its profiled
    steps). Multi-node plumbing in the autotuner tries ``pdsh`` first and logs a traceback
    when it is missing; the single-node experiments still run.
    """
    import subprocess

    work_dir = Path(work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "ds_config.json"
    config_path.write_text(json.dumps(autotuner_config(work_dir, dtype), indent=1))
    env = {k: v for k, v in os.environ.items() if k not in runtime.DISTRIBUTED_ENV_VARS}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    # The autotuner starts each experiment as plain `deepspeed ...`: it must be on PATH.
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in (bin_dir, env.get("PATH")) if p)
    script_args = [f"--{k}={v}" for k, v in model_args.items()]
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--autotuning", "tune", "--num_gpus", "1",
           "--master_port", str(runtime.free_port()), str(Path(__file__).resolve()),
           *script_args, "--deepspeed_config", str(config_path)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, cwd=work_dir, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        runtime.remove_stale_shm_buffers()   # each experiment leaves one
    seconds = time.time() - started
    experiments = []
    for metric_file in sorted((work_dir / "exps").parent.glob("**/metrics.json")):
        exp_dir = metric_file.parent
        cfg = json.loads((exp_dir / "ds_config.json").read_text())
        metrics = json.loads(metric_file.read_text())
        experiments.append({"name": exp_dir.name, "stage": cfg["zero_optimization"]["stage"],
                            "micro_batch_size": cfg["train_micro_batch_size_per_gpu"],
                            "throughput": metrics.get("throughput")})
    optimal = work_dir / "results" / "ds_config_optimal.json"
    if not optimal.exists():
        raise RuntimeError(f"the autotuner wrote no optimal config (exit {proc.returncode}); "
                           f"output ends:\n{(proc.stdout + proc.stderr)[-3000:]}")
    best_cfg = json.loads(optimal.read_text())
    best = {"stage": best_cfg["zero_optimization"]["stage"],
            "micro_batch_size": best_cfg["train_micro_batch_size_per_gpu"]}
    matches = [e for e in experiments if e["stage"] == best["stage"]
               and e["micro_batch_size"] == best["micro_batch_size"] and e["throughput"]]
    best["throughput"] = max((e["throughput"] for e in matches), default=None)
    # The autotuner explains its choices in its log (which stages it skips and why, which
    # micro-batches it tries); keep those lines without their timestamps.
    decisions = [line.split("] ", 1)[-1].strip() for line in (proc.stdout + proc.stderr).splitlines()
                 if any(key in line for key in AUTOTUNER_DECISION_LINES)]
    shown = ["deepspeed", "--autotuning", "tune", "--num_gpus", "1", "dschat_lib/autotune.py",
             *script_args, "--deepspeed_config", "ds_config.json"]
    return {"best": best, "experiments": experiments, "seconds": seconds, "command": " ".join(shown),
            "decisions": decisions, "config": autotuner_config("WORK_DIR", dtype),
            "returncode": proc.returncode}


def _train_for_autotuner(argv: list[str] | None = None) -> None:
    """The training program DeepSpeed's autotuner launches: it hands each experiment its
    config as ``--deepspeed_config`` (base64) and stops the process itself after profiling."""
    import deepspeed

    from dschat_lib import launching, models, training

    parser = launching.argument_parser("train a tiny causal LM for DeepSpeed's autotuner")
    parser.add_argument("--preset", default="cpu-tiny")
    parser.add_argument("--vocab_size", type=int, default=512)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    runtime.init_distributed()
    model = models.build_causal_lm(args.preset, vocab_size=args.vocab_size, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(args=args, model=model, optimizer=optimizer)
    batches = training.counting_batches(args.vocab_size, engine.train_micro_batch_size_per_gpu(),
                                        args.seq_len, seed=args.seed)
    training.run_steps(engine, batches, args.steps, progress=False)
    runtime.teardown(engine)


if __name__ == "__main__":
    _train_for_autotuner()
