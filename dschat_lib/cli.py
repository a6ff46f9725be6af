"""``python -m dschat_lib {step1,step2,step3,e2e} [options]`` — the pipeline from a shell.

Each step's options are named like DeepSpeed-Chat's ``main.py`` flags where the concept is
the same, and each step runs unchanged under ``deepspeed --num_gpus N -m dschat_lib ...`` (or
``torchrun``): the launcher's ``--local_rank`` argument is accepted and ignored in favour of
the LOCAL_RANK environment variable. ``python -m dschat_lib STEP --help`` lists the options.
"""

from __future__ import annotations

import importlib
import sys

#: Sub-command -> (module, one-line description). Modules are imported only when chosen, so
#: ``--help`` is instant and one step's dependencies never slow another's start-up.
STEPS = {
    "step1": ("dschat_lib.sft", "supervised fine-tuning of the actor (step 1)"),
    "step2": ("dschat_lib.reward", "reward-model training (step 2)"),
    "step3": ("dschat_lib.ppo", "RLHF with PPO (step 3)"),
    "e2e": ("dschat_lib.pipeline", "steps 1, 2 and 3 in sequence"),
}


def usage() -> str:
    lines = ["usage: python -m dschat_lib {" + ",".join(STEPS) + "} [options]", "", "steps:"]
    lines += [f"  {name:<6} {description}" for name, (_, description) in STEPS.items()]
    lines += ["", "Run 'python -m dschat_lib STEP --help' for a step's options."]
    return "\n".join(lines)


def split_local_rank(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate the ``--local_rank=N`` (or ``--local_rank N``) that the deepspeed launcher puts
    *before* the user's arguments, so the sub-command is found wherever it sits."""
    launcher_args, rest = [], []
    tokens = iter(argv)
    for token in tokens:
        if token.startswith("--local_rank="):
            launcher_args.append(token)
        elif token == "--local_rank":
            launcher_args += [token, next(tokens, "")]
        else:
            rest.append(token)
    return launcher_args, rest


def main(argv: list[str] | None = None) -> int:
    launcher_args, argv = split_local_rank(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    step, rest = argv[0], argv[1:] + launcher_args
    if step not in STEPS:
        print(f"unknown step {step!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(STEPS[step][0])
    if not hasattr(module, "main"):
        print(f"{step} is not available in this version of dschat_lib", file=sys.stderr)
        return 2
    result = module.main(rest)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
