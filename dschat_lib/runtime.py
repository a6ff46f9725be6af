"""The distributed runtime a notebook needs: one rank in-process, N ranks through a launcher.

DeepSpeed expects to run under a launcher that sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT. A notebook kernel has none of these, so
:func:`init_distributed` fills them in for a single rank (with a free port, so two kernels
never collide) before DeepSpeed initialises its process group — without them DeepSpeed falls
back to probing MPI. :func:`teardown` undoes it cleanly, so a reader can build engine after
engine in one kernel. :func:`launch` runs a module on N ranks with the ``deepspeed``
launcher and collects the JSON result each rank wrote.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

#: Environment variables a launcher sets for each rank. A child launched from a notebook
#: must not inherit the notebook's own single-rank values, or every child would be rank 0.
DISTRIBUTED_ENV_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")

#: Where a launched rank finds the directory to write its result into.
RESULT_DIR_ENV = "DSCHAT_RESULT_DIR"

LOOPBACK = "127.0.0.1"

#: DeepSpeed's CPU all-reduce (its shm_comm op, used when every rank of a launched job is on
#: one machine) gives each rank a shared-memory segment of about 66 MB named
#: ``deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` and never unlinks it, so every
#: launched CPU job leaves its segments in RAM until reboot. Measured here: 284 of them,
#: 19 GB of a 24 GB machine, after a day of runs.
SHM_BUFFER_PREFIX = "deepspeed_allreduce_buffer_"
SHM_DIR = Path("/dev/shm")


def remove_stale_shm_buffers(shm_dir: str | os.PathLike = SHM_DIR) -> list[str]:
    """Delete this user's DeepSpeed shared-memory all-reduce segments that no running process
    has mapped any more (see :data:`SHM_BUFFER_PREFIX`); return the names removed.

    A segment in use is mapped by its rank, so it shows in that process's ``/proc/<pid>/maps``
    and is kept; a finished job's segments are mapped by nobody and go.
    """
    shm_dir = Path(shm_dir)
    if not shm_dir.is_dir():
        return []
    mine = [p for p in shm_dir.glob(SHM_BUFFER_PREFIX + "*") if p.stat().st_uid == os.getuid()]
    if not mine:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:          # the process ended, or is not ours to read
            continue
        mapped.update(line.split(maxsplit=5)[-1] for line in text.splitlines() if SHM_BUFFER_PREFIX in line)
    removed = []
    for path in mine:
        if str(path) not in mapped:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def init_distributed() -> None:
    """Make this process rank 0 of a world of 1 (unless a launcher already set the env)
    and initialise DeepSpeed's process group. Safe to call repeatedly."""
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=LOOPBACK)
    if not deepspeed.comm.is_initialized():
        if os.environ.get("WORLD_SIZE", "1") == "1":
            # A world of one hosts its own rendezvous: take a port that is free *now*. The one
            # a torn-down group used may have been taken since (EADDRINUSE on a busy machine).
            # With several ranks the port is the launcher's and must be left alone.
            os.environ["MASTER_PORT"] = str(free_port())
        deepspeed.init_distributed(verbose=False)


def teardown(*engines: Any) -> None:
    """Release engines and the process group so the next ``deepspeed.initialize`` starts clean.

    ``torch.distributed.destroy_process_group()`` alone leaves DeepSpeed's communication
    wrapper pointing at a dead group and the next initialisation fails; DeepSpeed's own
    ``deepspeed.comm.destroy_process_group()`` resets both.
    """
    import deepspeed

    for engine in engines:
        if engine is not None:
            engine.destroy()
    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device() -> torch.device:
    """The accelerator DeepSpeed will use for this rank: a CUDA device when present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def default_dtype(dev: torch.device | None = None) -> torch.dtype:
    """bf16 where the hardware supports it (every recent CPU and Ampere+ GPU), else fp16."""
    dev = dev or device()
    if dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """The DeepSpeed/CLI spelling of a dtype: 'bf16', 'fp16' or 'fp32'."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so a run repeats exactly."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def environment_report() -> dict[str, str]:
    """Versions and hardware a reader should quote when reporting a result."""
    import deepspeed
    import transformers

    if torch.cuda.is_available():
        accelerator = f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    else:
        accelerator = f"cpu: {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "transformers": transformers.__version__,
        "accelerator": accelerator,
    }


# --------------------------------------------------------------------------- several ranks

def write_rank_result(payload: dict, result_dir: str | os.PathLike | None = None) -> Path:
    """Called inside a launched rank: write this rank's JSON result where :func:`launch` reads it.

    The file is written to a temporary name and renamed, so a reader never sees half a file.
    """
    result_dir = Path(result_dir or os.environ[RESULT_DIR_ENV])
    result_dir.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", 0))
    path = result_dir / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
    return path


class LaunchError(RuntimeError):
    """A launched job failed; the message carries the tail of its output."""


def launch(module: str, args: Sequence[str] = (), num_ranks: int = 2, result_dir: str | os.PathLike
           | None = None, launcher: str = "deepspeed", timeout: float = 600,
           extra_env: dict[str, str] | None = None, master_port: int | None = None) -> list[dict]:
    """Run ``python -m module args...`` on ``num_ranks`` ranks and return each rank's result.

    ``launcher`` is ``"deepspeed"`` (the DeepSpeed launcher, as on a GPU node) or
    ``"torchrun"``. Each rank is expected to call :func:`write_rank_result`. The results come
    back ordered by rank. On failure a :class:`LaunchError` shows the end of the output.
    ``master_port`` pins the rendezvous port (default: a free one).
    """
    import tempfile

    result_dir = Path(result_dir or tempfile.mkdtemp(prefix="dschat-launch-"))
    result_dir.mkdir(parents=True, exist_ok=True)
    for stale in result_dir.glob("rank*.json"):
        stale.unlink()

    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV_VARS}
    env[RESULT_DIR_ENV] = str(result_dir)
    # The child must import the same dschat_lib as this process, wherever it was copied to.
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update(extra_env or {})

    port = str(master_port or free_port())
    bin_dir = Path(sys.executable).parent
    if launcher == "deepspeed":
        # On a CPU-only machine --num_gpus is the number of local ranks to start.
        cmd = [str(bin_dir / "deepspeed"), "--num_gpus", str(num_ranks), "--master_port", port,
               "--module", module, *args]
    elif launcher == "torchrun":
        cmd = [str(bin_dir / "torchrun"), "--nproc_per_node", str(num_ranks), "--master_port",
               port, "-m", module, *args]
    else:
        raise ValueError(f"launcher must be 'deepspeed' or 'torchrun', not {launcher!r}")

    started = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        remove_stale_shm_buffers()
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise LaunchError(f"{' '.join(cmd)} exited with {proc.returncode} after "
                          f"{time.time() - started:.0f} s; output ends:\n{tail}")
    results = []
    for rank in range(num_ranks):
        path = result_dir / f"rank{rank}.json"
        if not path.exists():
            raise LaunchError(f"rank {rank} wrote no result to {path}; output ends:\n"
                              f"{(proc.stdout + proc.stderr)[-4000:]}")
        results.append(json.loads(path.read_text()))
    return results
