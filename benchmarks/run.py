"""``make bench`` / ``python benchmarks/run.py``: run a benchmark suite, write its JSON under
benchmarks/results/, and regenerate the book's appendix table from every JSON there.

    python benchmarks/run.py                    # the suite for this machine: gpu if CUDA, else cpu
    python benchmarks/run.py --suite cpu --skip-autotuner
    python benchmarks/run.py --render-only      # just rewrite book/appendix-benchmarks.md

On CPU it also runs DeepSpeed's own autotuner on the tiny model (about two minutes on an idle
2-core machine) and records its answer in results/deepspeed-autotuner-cpu.json, which the
autotuning chapter shows.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import render  # noqa: E402
import suites  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
AUTOTUNER_RESULT = RESULTS / "deepspeed-autotuner-cpu.json"
#: The model DeepSpeed's autotuner tunes: the same as the autotuning chapter's sweep.
AUTOTUNER_MODEL = {"preset": "cpu-tiny", "vocab_size": 512, "seq_len": 128}


def _guarded(label: str, fn, *args, **kwargs) -> dict:
    """Run one measurement; a failure (say, out of memory on a small GPU) becomes a row that
    says so instead of ending the whole suite."""
    print(f"[bench] {label}", flush=True)
    try:
        return fn(*args, **kwargs)
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}


def overhead(case: dict, steps: int, warmup: int, rounds: int = 2) -> dict:
    """DeepSpeed ZeRO-0 vs a plain PyTorch loop on the same model and math, alternating the
    two ``rounds`` times and keeping each side's fastest median (a shared machine's load
    hits both sides alike)."""
    from dschat_lib import benchmark

    plain, deepspeed = [], []
    for _ in range(rounds):
        plain.append(benchmark.plain_pytorch_step(case, steps, warmup))
        deepspeed.append(benchmark.deepspeed_step(case, steps, warmup))
    p = min(plain, key=lambda r: r["step_s"])
    d = min(deepspeed, key=lambda r: r["step_s"])
    return {"case": case, "plain": p, "deepspeed": d, "overhead": d["step_s"] / p["step_s"] - 1}


def generation(case: dict) -> dict:
    from dschat_lib import benchmark

    run = benchmark.zero3_generation(case)
    plain, zero3 = run["plain"], run
    return {"case": case, "zero3": zero3["zero3"], "gathered": zero3["gathered"],
            "gather_s": zero3["gather_s"], "plain": plain, "plain_after": run["plain_after"],
            "torch_threads": run.get("torch_threads"), "linear_replaced": run.get("linear_replaced"),
            "speedup_plain_over_zero3": plain["new_tokens_per_s"] / zero3["zero3"]["new_tokens_per_s"],
            "speedup_plain_after_over_zero3": run["plain_after"]["new_tokens_per_s"] / zero3["zero3"]["new_tokens_per_s"],
            "speedup_gathered_over_zero3": zero3["gathered"]["new_tokens_per_s"] / zero3["zero3"]["new_tokens_per_s"]}


def rlhf_steps(suite: dict, steps: int, warmup: int) -> dict:
    """Rows for the reward-model and PPO steps, from modules that provide ``benchmark_step``."""
    rows = {}
    for label, module_name in suites.PLUGGABLE_STEPS.items():
        if importlib.util.find_spec(module_name) is None:
            rows[label] = {"status": f"not measured: {module_name} does not exist yet"}
            continue
        module = importlib.import_module(module_name)
        if not hasattr(module, "benchmark_step"):
            rows[label] = {"status": f"not measured: {module_name} has no benchmark_step()"}
            continue
        case = suite.get("rlhf", {}).get(label, suite["sft"][0])
        rows[label] = {"status": "measured", **_guarded(label, module.benchmark_step, case, steps, warmup)}
    return rows


def book_execution() -> dict:
    """Seconds papermill measured for each executed notebook in _build/site (from the last
    `make test`/`make book`), and whether every notebook of the book has an executed copy."""
    sys.path.insert(0, str(ROOT / "tests"))
    import harness

    durations = {}
    for source in harness.source_notebooks():
        executed = harness.EXECUTED_DIR / source.name
        if executed.exists():
            durations[source.stem] = round(harness.duration_s(executed), 1)
    missing = [p.stem for p in harness.source_notebooks() if p.stem not in durations]
    return {"notebooks": durations, "total_s": round(sum(durations.values()), 1),
            "complete": not missing, "missing": missing}


def run_suite(name: str) -> dict:
    import torch

    from dschat_lib import benchmark

    suite = suites.SUITES[name]
    steps, warmup = suite["steps"]
    started = time.time()
    result = {"suite": name, "environment": benchmark.environment(), "targets": suites.TARGETS,
              "recorded_opt_1_3b_sft": benchmark.RECORDED_OPT_1_3B_SFT}
    result["sft"] = []
    for case in suite["sft"]:
        row = _guarded(case["name"], benchmark.deepspeed_step, case, steps, warmup)
        result["sft"].append({**case, **row})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result["overhead"] = _guarded("overhead", overhead, suite["overhead"], suites.OVERHEAD_STEPS,
                                  suites.OVERHEAD_WARMUP, suites.OVERHEAD_ROUNDS)
    result["generation"] = _guarded("generation", generation, suite["generation"])
    result["rlhf_steps"] = rlhf_steps(suite, steps, warmup)
    result["book_execution"] = book_execution()
    result["environment"]["load_average_after"] = benchmark.environment()["load_average_1_5_15"]
    result["wall_s"] = round(time.time() - started, 1)
    return result


def run_autotuner() -> dict:
    from dschat_lib import autotune, benchmark

    environment = benchmark.environment()
    with tempfile.TemporaryDirectory(prefix="ds-autotuner-") as work:
        tuned = autotune.run_deepspeed_autotuner(work, AUTOTUNER_MODEL)
    environment["load_average_after"] = benchmark.environment()["load_average_1_5_15"]
    return {"model": AUTOTUNER_MODEL, "environment": environment, **tuned}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--suite", choices=["auto", *suites.SUITES], default="auto")
    parser.add_argument("--skip-autotuner", action="store_true")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.render_only:
        import torch

        warnings.filterwarnings("ignore")
        name = args.suite if args.suite != "auto" else ("gpu" if torch.cuda.is_available() else "cpu")
        started = time.time()
        result = run_suite(name)
        from dschat_lib import benchmark

        benchmark.write_json(result, RESULTS / f"{name}.json")
        print(f"[bench] wrote {RESULTS / f'{name}.json'} after {time.time() - started:.0f} s")
        if name == "cpu" and not args.skip_autotuner:
            tuned = _guarded("DeepSpeed autotuner", run_autotuner)
            if "error" not in tuned:
                benchmark.write_json(tuned, AUTOTUNER_RESULT)
        # The whole command's time, autotuner included, against the 10-minute budget.
        result["bench_wall_s"] = round(time.time() - started, 1)
        result["autotuner_ran"] = name == "cpu" and not args.skip_autotuner
        benchmark.write_json(result, RESULTS / f"{name}.json")
        print(f"[bench] all done in {result['bench_wall_s']:.0f} s")
    path = render.write_appendix()
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
