"""Render benchmarks/results/*.json into book/appendix-benchmarks.md.

Every number on the page is formatted here from the JSON; nothing is typed by hand, and
tests/test_benchmarks.py checks that the committed page equals a fresh rendering.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
APPENDIX = ROOT / "book" / "appendix-benchmarks.md"
MIB = 2**20


def load_results(results_dir: Path = RESULTS) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*.json"))}


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _hardware(env: dict) -> str:
    load = env.get("load_average_1_5_15")
    after = env.get("load_average_after")
    text = (f"{env.get('gpu') or env['accelerator']}; {env.get('processor', '')}; torch {env['torch']}, "
            f"deepspeed {env['deepspeed']}, transformers {env['transformers']}; measured {env['date']}")
    if load and after:
        text += f"; load average {load[0]:.1f} at the start, {after[0]:.1f} at the end"
    elif load:
        text += f"; load average {load[0]:.1f} when recorded"
    return text


def _sft_rows(result: dict) -> list[list[str]]:
    rows = []
    for row in result["sft"]:
        if "error" in row:
            rows.append([row["name"], "failed: " + row["error"][:80], "", "", "", "", ""])
            continue
        rows.append([row["name"], f"{row['micro_batch_size']} × {row['seq_len']}",
                     f"{row['samples_per_s']:.1f}", f"{row['tokens_per_s']:,.0f}",
                     f"{row['model_tflops']:.3g}", f"{100 * row['mfu']:.1f} % ({row['peak_source']})",
                     f"{row['peak_memory_bytes'] / MIB:,.0f}"])
    return rows


def _rlhf_rows(rlhf: dict) -> list[list[str]]:
    rows = []
    for label, row in rlhf.items():
        if row.get("status") != "measured" or "error" in row:
            reason = row.get("error") or row.get("status", "failed")
            rows.append([label, reason[:80], "", "", "", "", "", ""])
            continue
        case = row["name"]
        rows.append([label, case, f"{row['micro_batch_size']} × {row['seq_len']}", f"{row['samples_per_s']:.1f}",
                     f"{row['tokens_per_s']:,.0f}", f"{row['model_tflops']:.3g}",
                     f"{100 * row['mfu']:.1f} % ({row['peak_source']})", f"{row['peak_memory_bytes'] / MIB:,.0f}"])
    return rows


def _baseline_rows(result: dict) -> list[list[str]]:
    targets, rows = result["targets"], []
    over = result.get("overhead", {})
    if "error" in over or not over:
        rows.append(["DeepSpeed ZeRO-0 step vs plain PyTorch loop", "failed", "", ""])
    else:
        rows.append([f"DeepSpeed ZeRO-0 step vs plain PyTorch loop ({over['case']['name']})",
                     f"{over['deepspeed']['step_s'] * 1e3:.1f} ms vs {over['plain']['step_s'] * 1e3:.1f} ms",
                     f"overhead {100 * over['overhead']:+.1f} %",
                     f"≤ {100 * targets['zero0_overhead_max']:.0f} %"])
    gen = result.get("generation", {})
    if "error" in gen or not gen:
        rows.append(["generation: plain module vs ZeRO-3 engine", "failed", "", ""])
    else:
        z3 = gen["zero3"]["new_tokens_per_s"]
        rows.append(["generation: plain module, built before any engine, vs ZeRO-3 engine (new tokens/s)",
                     f"{gen['plain']['new_tokens_per_s']:,.0f} vs {z3:,.0f}",
                     f"{gen['speedup_plain_over_zero3']:.1f}×", f"≥ {targets['generation_speedup_min']:.0f}×"])
        if "plain_after" in gen:
            rows.append(["generation: plain module, built after the engine, vs ZeRO-3 engine",
                         f"{gen['plain_after']['new_tokens_per_s']:,.0f} vs {z3:,.0f}",
                         f"{gen['speedup_plain_after_over_zero3']:.1f}×", f"≥ {targets['generation_speedup_min']:.0f}×"])
        rows.append(["generation: copy gathered from the ZeRO-3 engine vs the engine",
                     f"{gen['gathered']['new_tokens_per_s']:,.0f} vs {z3:,.0f} (gather {gen['gather_s']:.2f} s)",
                     f"{gen['speedup_gathered_over_zero3']:.1f}×", f"≥ {targets['generation_speedup_min']:.0f}×"])
    recorded = result["recorded_opt_1_3b_sft"]
    for row in result["sft"]:
        if row.get("compare_with_recorded") and "error" not in row:
            rows.append([f"{row['name']} vs the recorded DeepSpeed-Chat run",
                         f"{row['samples_per_s']:.1f} vs {recorded['samples_per_s']:.0f} samples/s; "
                         f"{row['model_tflops']:.0f} vs {recorded['tflops']:.0f} TFLOP/s",
                         f"{row['samples_per_s'] / recorded['samples_per_s']:.2f}×", "—"])
        if row.get("target") and "error" not in row:
            rows.append([row["name"], f"{row['samples_per_s']:.1f} samples/s",
                         f"{row['samples_per_s'] / recorded['samples_per_s']:.2f}× the recorded run",
                         f"≥ {targets['opt_1_3b_bf16_samples_per_s_min']:.0f} samples/s"])
    return rows


def _suite_section(title: str, result: dict) -> list[str]:
    took = f"The suite took {result['wall_s']:.0f} s"
    if "bench_wall_s" in result:
        took += (f"; `make bench` took {result['bench_wall_s']:.0f} s in all"
                 + (", DeepSpeed's autotuner included" if result.get("autotuner_ran") else ""))
    out = [f"## {title}", "", f"*Hardware and software:* {_hardware(result['environment'])}. {took}.", "",
           "### Training step (causal-LM loss, as in step 1 SFT)", "",
           _table(["case", "micro-batch × tokens", "samples/s", "tokens/s", "model TFLOP/s", "MFU",
                   "peak memory (MiB)"], _sft_rows(result)), "",
           "### Baselines and targets", "",
           _table(["comparison", "measured", "ratio", "target"], _baseline_rows(result)), ""]
    gen = result.get("generation", {})
    if "plain_after" in gen:
        ratio = gen["plain_after"]["new_tokens_per_s"] / gen["plain"]["new_tokens_per_s"]
        change = f"{ratio:.1f}× as fast" if ratio >= 1 else f"{1 / ratio:.1f}× slower"
        text = (f"The same plain module generated {change} when built after the ZeRO-3 engine, in the same "
                f"process, as before it (same torch thread count, {gen.get('torch_threads')}).")
        if gen.get("linear_replaced"):
            text += (" One process-wide change is known: the ZeRO-3 engine replaced "
                     "`torch.nn.functional.linear` with its memory-saving autograd function (ZeRO config "
                     "`memory_efficient_linear`, on by default), and every model in the process, plain or not, "
                     "runs through it from then on.")
        out += [text + " Rollouts in PPO come from the process that holds the training engine, which is "
                "the gathered-copy row.", ""]
    rlhf = result.get("rlhf_steps", {})
    if rlhf:
        out += ["### Reward-model and PPO steps", "",
                _table(["step", "case", "micro-batch × tokens", "samples/s", "tokens/s", "model TFLOP/s",
                        "MFU", "peak memory (MiB)"], _rlhf_rows(rlhf)), ""]
        ppo = rlhf.get("PPO (step 3)", {})
        if "experience_share" in ppo:
            out += [f"A PPO sample is one prompt ({ppo['prompt_len']} tokens) with its sampled response "
                    f"(up to {ppo['answer_len']} tokens); making the experience — sampling plus the four "
                    f"models' scoring passes — took {100 * ppo['experience_share']:.0f} % of each iteration, "
                    "the actor and critic updates the rest. A reward-model sample is a chosen/rejected pair, "
                    "so its tokens/s counts both sequences.", ""]
    book = result.get("book_execution")
    if book and book["notebooks"]:
        minutes = book["total_s"] / 60
        limit = result["targets"]["book_cpu_minutes_max"]
        total = len(book["notebooks"]) + len(book["missing"])
        scope = (f"all {total} notebooks" if book["complete"]
                 else f"{len(book['notebooks'])} of the book's {total} notebooks")
        out += ["### The whole book", "",
                f"Executing {scope} with their default parameters took {minutes:.1f} minutes in total "
                f"(papermill's own timings from the last `make test`; target ≤ {limit:.0f} minutes on 2 CPU cores)"
                + ("." if book["complete"] else
                   f"; not yet executed there: {', '.join(book['missing'])}, so this is a partial sum."), ""]
    return out


def render(results: dict[str, dict]) -> str:
    out = ["# Appendix: benchmarks", "",
           "```{note}",
           "Generated by `make bench` (`python benchmarks/run.py`) from the JSON files in "
           "`benchmarks/results/`; do not edit by hand. Timings taken on a shared machine carry the "
           "load average they were taken under.",
           "```", "",
           "## How the numbers are computed", "",
           "- **Step time** is the median of several timed optimizer steps after warm-up steps; "
           "**samples/s** = micro-batch ÷ step time and **tokens/s** = samples/s × sequence length.",
           "- **Model FLOPs per token** of a training step: $6N + 12 L H S$ — six FLOPs per parameter "
           "(two forward, four backward) plus the attention products ($L$ layers, width $H$, "
           "sequence length $S$).",
           "- **Reward-model step** (step 2): a sample is a chosen/rejected pair, two sequences scored in "
           "one forward pass, so tokens/s counts both; FLOPs per token as for training.",
           "- **PPO iteration** (step 3): a sample is one prompt with its response. Its FLOPs per token add "
           "every pass over the $S$ = prompt + response tokens, each forward costing $2N + 4LHS$: "
           "sampling (one actor forward — a KV cache makes prefill plus decoding one forward's matmuls), "
           "the experience passes (actor, reference, critic, reward model) and the actor and critic "
           "updates (forward + backward, three forwards each): six forwards of the actor's shape and "
           "five of the critic's per token.",
           "- **Model TFLOP/s** = tokens/s × FLOPs per token; **MFU** = model TFLOP/s ÷ peak TFLOP/s, "
           "the peak being the datasheet's dense 16-bit figure on a known GPU, otherwise the best of "
           "several large matmuls measured on the same device and dtype (the table says which).",
           "- **Peak memory** is tensor bytes alive at once during a step (`max_memory_allocated` on a "
           "GPU; on a CPU the engine's live tensors plus the profiler's peak of one step's allocations).",
           ""]
    if "cpu" in results:
        out += _suite_section("CPU: the tiny preset", results["cpu"])
    if "gpu" in results:
        out += _suite_section("GPU: OPT shapes", results["gpu"])
    else:
        reference = next(iter(results.values()), {})
        recorded, targets = reference.get("recorded_opt_1_3b_sft"), reference.get("targets")
        text = ("**GPU figures are not yet recorded.** No machine that ran this suite so far had a GPU. "
                "The GPU suite is ready and runs unchanged on one: `make bench` on a CUDA machine "
                "measures the OPT-125M, OPT-350M and OPT-1.3B shapes (random weights) in bf16 and fp16 at "
                "8 × 512 tokens, the OPT-1.3B configuration a DeepSpeed-Chat user recorded on one GPU")
        if recorded and targets:
            text += (f" ({recorded['dtype']}, micro-batch {recorded['micro_batch_size']} × {recorded['seq_len']} "
                     f"tokens, LoRA dim {recorded['lora_dim']}, ZeRO-{recorded['stage']}: about "
                     f"{recorded['seconds_per_micro_batch']:.2f} s per micro-batch, {recorded['samples_per_s']:.0f} "
                     f"samples/s, {recorded['tflops']:.0f} TFLOP/s), and OPT-1.3B in bf16 at larger micro-batches "
                     f"against this book's target of {targets['opt_1_3b_bf16_samples_per_s_min']:.0f} samples/s "
                     "on one H100")
        out += ["## GPU: OPT shapes", "", text + ".", ""]
    tuner = results.get("deepspeed-autotuner-cpu")
    if tuner:
        best = tuner["best"]
        out += ["## DeepSpeed's autotuner on the tiny model", "",
                f"`{tuner['command']}` ran {len(tuner['experiments'])} experiments in {tuner['seconds']:.0f} s "
                f"and chose ZeRO-{best['stage']} with micro-batch {best['micro_batch_size']}"
                + (f" ({best['throughput']:.1f} samples/s by its own measure)" if best.get("throughput") else "")
                + f". *Hardware:* {_hardware(tuner['environment'])}. The autotuning chapter compares this "
                "answer with its own sweep.", "",
                _table(["experiment", "ZeRO stage", "micro-batch", "samples/s"],
                       [[e["name"], str(e["stage"]), str(e["micro_batch_size"]),
                         "—" if e["throughput"] is None else f"{e['throughput']:.1f}"]
                        for e in tuner["experiments"]]), ""]
    return "\n".join(out).rstrip() + "\n"


def write_appendix(results_dir: Path = RESULTS, path: Path = APPENDIX) -> Path:
    path.write_text(render(load_results(results_dir)))
    return path


if __name__ == "__main__":
    print(f"wrote {write_appendix()}")
