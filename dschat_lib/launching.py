"""Launching DeepSpeed jobs: the script side (arguments) and the cluster side (hostfiles, envs).

Two halves, both small:

- What a training *script* needs to run under ``deepspeed`` or ``torchrun``:
  :func:`argument_parser` accepts the ``--local_rank`` argument the DeepSpeed launcher passes
  (a script that does not accept it dies with "unrecognized arguments: --local_rank=0") and
  DeepSpeed's own ``--deepspeed``/``--deepspeed_config`` arguments.
- What the *launcher* does with a hostfile: :func:`hostfile_problems` explains what is wrong
  with one in words, :func:`resolve_resources` applies ``--include``/``--exclude`` and
  ``--num_nodes``/``--num_gpus`` with DeepSpeed's own functions, and
  :func:`multinode_command` builds the exact ``pdsh`` command (with its ``export`` list) that
  ``deepspeed --hostfile ...`` would run — without needing the cluster, so a reader can see
  which environment variables reach the other nodes before booking them.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import socket
from typing import Mapping, Sequence

#: The hostfile line DeepSpeed accepts (``deepspeed.launcher.runner._parse_hostfile``):
#: a host name, white space, ``slots=N``. Anything after is ignored by DeepSpeed.
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")

#: Where the DeepSpeed launcher looks for the file of extra variables to export to every node
#: (``DEEPSPEED_ENVIRONMENT_PATHS`` in ``deepspeed/launcher/runner.py``): home, then the
#: current directory. The file name can be changed with the ``DS_ENV_FILE`` variable.
DEEPSPEED_ENV_FILE = ".deepspeed_env"

#: NCCL variables people set most often, with what they do (from NVIDIA's NCCL environment
#: variable documentation). The multi-node launcher exports every ``NCCL_*`` variable of the
#: launching shell to all nodes on a CUDA machine.
NCCL_VARIABLES = {
    "NCCL_DEBUG": "INFO prints the transport chosen (IB, socket, P2P, SHM) at start-up; WARN by default",
    "NCCL_SOCKET_IFNAME": "network interface(s) for bootstrap and socket transport, e.g. eth0 or ^lo,docker",
    "NCCL_IB_DISABLE": "1 disables InfiniBand and falls back to sockets (slow; a diagnosis, not a fix)",
    "NCCL_P2P_DISABLE": "1 disables direct GPU-to-GPU (NVLink/PCIe) transfers inside a node",
    "NCCL_SHM_DISABLE": "1 disables the shared-memory transport between processes on one node",
    "NCCL_ASYNC_ERROR_HANDLING": "1 turns a hung collective into an error after the timeout instead of a hang",
}


# --------------------------------------------------------------------------- the script side

def argument_parser(description: str | None = None) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` a script can extend that works under every launcher.

    - ``--local_rank`` (also spelled ``--local-rank``): the DeepSpeed launcher appends
      ``--local_rank=N`` to the script's arguments unless run with ``--no_local_rank``;
      torchrun sets ``LOCAL_RANK`` in the environment instead. The default reads that
      variable, so ``args.local_rank`` is right either way (-1 when not launched at all).
    - DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (a JSON path, or the base64 string
      the autotuner passes): added by ``deepspeed.add_config_arguments``. Hand the parsed
      ``args`` to ``deepspeed.initialize(args=args, ...)``.
    """
    import deepspeed

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--local_rank", "--local-rank", type=int,
                        default=int(os.environ.get("LOCAL_RANK", -1)),
                        help="set by the launcher; do not pass by hand")
    return deepspeed.add_config_arguments(parser)


def load_config_argument(value: str) -> dict:
    """The ds_config named by ``--deepspeed_config``: a JSON file, or base64-encoded JSON
    (how DeepSpeed's autotuner hands each experiment its config)."""
    if os.path.isfile(value):
        with open(value) as handle:
            return json.load(handle)
    return json.loads(base64.urlsafe_b64decode(value).decode())


# --------------------------------------------------------------------------- the cluster side

def hostfile_problems(text: str) -> list[str]:
    """Everything wrong with a hostfile, one sentence each; an empty list when it is good.

    DeepSpeed stops at the first problem and reports the whole file; this lists each one with
    its line number, and also flags what DeepSpeed accepts but rarely means: zero slots, and
    text after ``slots=N`` (DeepSpeed ignores it silently).
    """
    problems, seen = [], {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(line)
        if not match:
            problems.append(f"line {number}: {line!r} is not 'HOST slots=N'")
            continue
        host, slots = match.group(1), int(match.group(2))
        if host in seen:
            problems.append(f"line {number}: host {host!r} is listed again (first on line {seen[host]})")
        seen.setdefault(host, number)
        if slots == 0:
            problems.append(f"line {number}: host {host!r} has slots=0, so it contributes no ranks")
        rest = line[match.end():].strip()
        if rest:
            problems.append(f"line {number}: {rest!r} after slots={slots} is ignored by DeepSpeed")
    if not seen and not problems:
        problems.append("the hostfile lists no hosts")
    return problems


def parse_hostfile(text: str) -> dict[str, int]:
    """Host → slots, parsed by DeepSpeed's own parser (so it fails exactly where the launcher
    would), after :func:`hostfile_problems` found nothing to complain about."""
    from deepspeed.launcher.runner import _parse_hostfile

    problems = hostfile_problems(text)
    if problems:
        raise ValueError("bad hostfile:\n  " + "\n  ".join(problems))
    return dict(_parse_hostfile(text.splitlines()))


def resolve_resources(hostfile_text: str, include: str = "", exclude: str = "",
                      num_nodes: int = -1, num_gpus: int = -1) -> dict[str, list[int]]:
    """The ranks' placement the DeepSpeed launcher would use: host → list of slot (GPU) ids.

    ``include``/``exclude`` use the launcher's syntax ``NAME[:SLOT[,SLOT...]][@NAME...]``,
    e.g. ``"worker-0@worker-1:0,2"``; they exclude each other and ``num_nodes``/``num_gpus``.
    """
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, parse_inclusion_exclusion

    if (include or exclude) and (num_nodes > 0 or num_gpus > 0):
        raise ValueError("--include/--exclude cannot be combined with --num_nodes/--num_gpus")
    pool = parse_hostfile(hostfile_text)
    active = parse_inclusion_exclusion(pool, include, exclude)
    return {host: list(slots) for host, slots in apply_num_nodes_and_gpus(active, num_nodes, num_gpus).items()}


def world_size(resources: Mapping[str, Sequence[int]]) -> int:
    return sum(len(slots) for slots in resources.values())


def rank_layout(resources: Mapping[str, Sequence[int]]) -> list[dict]:
    """Global rank, node, local rank and GPU slot of every rank, in the launcher's order
    (hosts in hostfile order, slots in the given order; global ranks count across nodes)."""
    layout, rank = [], 0
    for node_rank, (host, slots) in enumerate(resources.items()):
        for local_rank, slot in enumerate(slots):
            layout.append({"rank": rank, "host": host, "node_rank": node_rank,
                           "local_rank": local_rank, "slot": slot})
            rank += 1
    return layout


def deepspeed_env_text(variables: Mapping[str, str]) -> str:
    """The contents of a ``.deepspeed_env`` file: one ``NAME=value`` per line.

    The launcher reads it only for multi-node runs and exports each line on every node, so it
    is the place for variables DeepSpeed does not propagate by itself (it propagates
    ``PYTHON*``, ``MLFLOW*``, ``MV2*``, ``UCX*`` and, on CUDA machines, ``NCCL*``).
    """
    for name, value in variables.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"{name!r} is not a valid environment variable name")
        if "\n" in str(value):
            raise ValueError(f"the value of {name} contains a newline")
    return "".join(f"{name}={value}\n" for name, value in variables.items())


def multinode_command(hostfile_text: str, user_script: str, user_args: Sequence[str] = (),
                      include: str = "", exclude: str = "", master_addr: str | None = None,
                      master_port: int = 29500, environ: Mapping[str, str] | None = None,
                      deepspeed_env: Mapping[str, str] | None = None,
                      accelerator_exports: Sequence[str] | None = None) -> dict:
    """What ``deepspeed --hostfile H [--include/--exclude] SCRIPT ARGS`` runs on a cluster.

    Built with DeepSpeed's own ``PDSHRunner`` — the default multi-node backend — so the result
    is the command the launcher would hand to ``pdsh`` (which need not be installed to see it).
    ``environ`` stands for the launching shell's environment (default: this process's) and
    ``deepspeed_env`` for the lines of a ``.deepspeed_env`` file. ``accelerator_exports`` are
    the prefixes the accelerator adds (``["NCCL"]`` on CUDA; default: this machine's).

    Returns ``{"resources", "world_size", "exports", "command"}``.
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.multinode_runner import PDSHRunner
    from deepspeed.launcher.runner import EXPORT_ENVS, encode_world_info, parse_args

    resources = resolve_resources(hostfile_text, include=include, exclude=exclude)
    master_addr = master_addr or next(iter(resources))
    args = parse_args(["--master_addr", master_addr, "--master_port", str(master_port),
                       user_script, *user_args])
    runner = PDSHRunner(args, encode_world_info(resources))
    environ = dict(os.environ if environ is None else environ)
    prefixes = list(EXPORT_ENVS) + list(get_accelerator().export_envs() if accelerator_exports is None
                                        else accelerator_exports)
    # The same selection the launcher makes in deepspeed/launcher/runner.py: every variable
    # whose name starts with an exported prefix, then the .deepspeed_env lines on top.
    for name, value in environ.items():
        if any(name.startswith(prefix) for prefix in prefixes):
            runner.add_export(name, value)
    for name, value in (deepspeed_env or {}).items():
        runner.add_export(name, value)
    cmd, _kill_cmd, _env = runner.get_cmd(dict(environ), resources)
    return {"resources": resources, "world_size": world_size(resources),
            "exports": dict(runner.exports), "command": cmd}


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on ``host:port`` (then a launcher's rendezvous there
    fails with "address already in use")."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex((host, port)) == 0
