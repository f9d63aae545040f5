"""Benchmark: compile full GLM-5.2 plans, each in a fresh process, and print the figures.

Usage: python benchmarks/bench_compile.py [--out DIR] [--only TEXT ...] [--repeat N] [--smoke]   (make bench-compile)
--smoke compiles one tiny plan instead (tests/configs/fp8-glm, fsdp=2 -> dp=2,ep, fp8_per_block): it checks that
every step runs, not the figures (tests/e2e/test_benchmark_smoke.py).
Each plan is compiled in a fresh worker process, which then loads and summarizes the plan
(src_balance); wall_s/cpu_s run from launching the worker to the plan being written, and
worker_wall_s/worker_cpu_s cover the whole worker, summary included.
Per plan: the per-phase breakdown (setup = importing vLLM + engine configs + trainer table,
build = vLLM models on meta, trace, passes, write; wall and CPU seconds), in-process compile
time, process wall time (includes importing torch), CPU time, peak RSS, how many models were
built and how the shared-model guard ended, checkpoint names not fed and post-load traces run,
assignments, runs before/after coalescing,
descriptor lower bound, plan file size and whether it is byte-identical to the checked-in plan.
With the seed plan among those compiled, each plan's compile CPU is also printed over the seed plan's
(issue 30: the pipelined plans compile no slower than the seed plan). --repeat N compiles the selected
plans N times, round by round (the seed, then the others, then again), and reports each plan's median
round: this machine is shared, and one compile's CPU time varies by a third.
The last line is a JSON array, one object per plan; its "plan" names the plan file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

PLANS = [
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16"},
    {"model": "glm-5.2", "trainer_format": "hf", "trainer_dtype": "bf16"},
    # The seed topology (issue: parallel layouts): targets 60 s wall, 4 GB RSS, 16 MB plan, src_balance <= 1.10.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep"},
    # The same trainer to plain vLLM TP=8: each expert's down_proj column slice is one strided run.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "tp=8"},
    # The seed topology with vLLM's online fp8_per_block (issue 5): targets wire_bytes <= 1.05 x dst_bytes, 60 s.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "dp=32,ep",
     "quant": "fp8_per_block"},
    # Pipeline parallelism (issue 30): two 8-GPU inference nodes as vLLM pipeline stages, and a 4-stage trainer.
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "fsdp=64,ep=8", "inference": "tp=8,pp=2"},
    {"model": "glm-5.2", "trainer_format": "stacked", "trainer_dtype": "bf16", "trainer": "pp=4,fsdp=16,ep=8", "inference": "dp=32,ep"},
]
SEED = PLANS[2]
SMOKE_PLANS = [
    {"model": str(REPO / "tests" / "configs" / "fp8-glm"), "trainer_format": "hf", "trainer_dtype": "bf16", "trainer": "fsdp=2",
     "inference": "dp=2,ep", "quant": "fp8_per_block"},
]


def worker(spec: dict, output: str) -> None:
    from weightplan.compiler.compile import CompileOptions, compile_plan

    from weightplan.compiler.plan_summary import summarize
    from weightplan.runtime import load_plan

    from weightplan.compiler.compile import default_plan_path

    result = compile_plan(CompileOptions(**spec, output=Path(output)))
    compiled_at, compiled_cpu = time.time(), time.process_time()  # the compile ends here; the summary is extra
    summary = summarize(load_plan(output))
    origin = result.program.origin
    name = default_plan_path(origin.model, origin.trainer, origin.inference, origin.quant)
    checked_in = REPO / name
    print(json.dumps({"timings": result.timings, "stats": result.stats, "plan_bytes": result.plan_bytes,
                      "src_balance": summary["src_balance"], "dst_balance": summary["dst_balance"],
                      "compiled_at": compiled_at, "compiled_cpu": compiled_cpu,
                      "plan": str(name), "identical_to_checked_in": checked_in.read_bytes() == Path(output).read_bytes() if checked_in.exists() else None,
                      "wire_bytes": summary["wire_bytes"], "dst_bytes": summary["dst_bytes"],
                      "sender_quantized_fraction": summary["sender_quantized_fraction"],
                      "gather_quantized_fraction": summary["gather_quantized_fraction"],
                      "gather_bytes": summary["gather_bytes"]}))


def run(spec: dict, out_dir: Path) -> dict:
    layouts = f"{spec.get('trainer', 'fsdp=1')} -> {spec.get('inference', 'tp=1')}"
    quant = spec.get("quant", "none")
    output = out_dir / (f"{Path(spec['model']).name}-{spec['trainer_format']}-{spec['trainer_dtype']}-{layouts}-{quant}.plan".replace(" ", "").replace(">", ""))
    start, launched = time.perf_counter(), time.time()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(spec), str(output)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"compile of {spec} failed with status {status}")
    r = json.loads(stdout.strip().splitlines()[-1])
    t, s = r["timings"], r["stats"]
    return {
        "plan": r["plan"],
        "layouts": f"{Path(spec['model']).name} {spec['trainer_format']}-{spec['trainer_dtype']} {layouts} {quant}",
        "compile_s": round(t["total"], 2),
        "wall_s": round(r["compiled_at"] - launched, 2),
        "cpu_s": round(r["compiled_cpu"], 2),
        "worker_wall_s": round(wall, 2),
        "worker_cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "compile_cpu_s": round(t["total_cpu"], 2),
        "setup_s": round(t["setup"], 2),
        "build_s": round(t["build"], 2),
        "trace_s": round(t["trace"], 2),
        "write_s": round(t["write"], 2),
        "passes_s": round(t["passes"], 2),
        **{f"{phase}_cpu_s": round(t[f"{phase}_cpu"], 2) for phase in ("setup", "build", "trace", "passes", "write")},
        "derive_cpu_s": round(t.get("derive_cpu", 0.0), 2),
        "models_built": s["models_built"],
        "guard": s["guard"],
        "tp_ranks_derived": s.get("tp_ranks_derived", 0),
        "tp_guard": s.get("tp_guard", "off"),
        "names_skipped": s.get("names_skipped", 0),
        "post_load_traces": s.get("post_load_traces", 0),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "assignments": s["assignments"],
        "runs_before_coalesce": s["runs_before_coalesce"],
        "descriptors": s["descriptors"],
        "descriptors_lower_bound": s["descriptors_lower_bound"],
        "plan_bytes": r["plan_bytes"],
        "src_balance": round(r["src_balance"], 4),
        "dst_balance": round(r["dst_balance"], 4),
        "identical_to_checked_in": r["identical_to_checked_in"],
        "wire_over_dst": round(r["wire_bytes"] / r["dst_bytes"], 4),
        "sender_quantized_fraction": round(r["sender_quantized_fraction"], 4),
        "gather_quantized_fraction": round(r["gather_quantized_fraction"], 4),
        "gather_over_dst": round(r["gather_bytes"] / r["dst_bytes"], 4),
    }


def _quant(row: dict) -> str:
    if not row["post_load_traces"]:
        return ""
    return (f"wire/dst {row['wire_over_dst']} (of which between trainer ranks {row['gather_over_dst']}), "
            f"sender_quantized_fraction {row['sender_quantized_fraction']}, gather_quantized_fraction "
            f"{row['gather_quantized_fraction']}, {row['post_load_traces']} post-load traces; ")


def _identity(row: dict) -> str:
    if row["identical_to_checked_in"] is None:
        return "no checked-in plan to compare"
    return f"identical to the checked-in plan: {row['identical_to_checked_in']}"


def _selected(specs: list[dict], only: list[str] | None) -> list[dict]:
    def text(spec):
        return f"{spec.get('trainer', 'fsdp=1')} -> {spec.get('inference', 'tp=1')} {spec['trainer_format']} {spec.get('quant', 'none')}"
    return [spec for spec in specs if not only or any(o in text(spec) for o in only)]


def _median_round(rows: list[dict]) -> dict:
    """The round whose compile CPU is the median of `rows` (the lower middle one for an even count)."""
    return sorted(rows, key=lambda row: row["compile_cpu_s"])[(len(rows) - 1) // 2]


def _print(row: dict) -> None:
    print(
        f"{row['plan']} ({row['layouts']}): compile {row['compile_s']} s in-process, {row['compile_cpu_s']} s CPU "
        f"(wall/CPU s: setup {row['setup_s']}/{row['setup_cpu_s']}, build {row['build_s']}/{row['build_cpu_s']}, "
        f"trace {row['trace_s']}/{row['trace_cpu_s']}, derive -/{row['derive_cpu_s']}, passes {row['passes_s']}/{row['passes_cpu_s']}, "
        f"write {row['write_s']}/{row['write_cpu_s']}), "
        f"{row['wall_s']} s wall / {row['cpu_s']} s CPU from process start to plan written (incl. imports), "
        f"peak RSS {row['peak_rss_mb']} MB; "
        f"{row['models_built']} vLLM models built, guard: {row['guard']}, {row['names_skipped']} checkpoint names skipped, "
        f"{row['tp_ranks_derived']} TP ranks derived (guard: {row['tp_guard']}); "
        f"{row['assignments']} assignments, {row['runs_before_coalesce']} runs -> {row['descriptors']} descriptors "
        f"(lower bound {row['descriptors_lower_bound']}); plan {row['plan_bytes']} bytes; "
        f"src_balance {row['src_balance']}, dst_balance {row['dst_balance']}; {_quant(row)}{_identity(row)}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUTPUT"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", metavar="TEXT", action="append",
                        help="compile only the plans whose layouts contain TEXT, e.g. dp=32 (repeat for several)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="compile the selected plans N times, round by round")
    parser.add_argument("--smoke", action="store_true", help="one tiny plan: checks it runs, not its figures")
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker[0]), args.worker[1])
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, not {args.repeat}")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench-compile-"))
    specs = _selected(SMOKE_PLANS if args.smoke else PLANS, args.only)
    rounds: dict[int, list[dict]] = {i: [] for i in range(len(specs))}
    for _ in range(args.repeat):
        for i, spec in enumerate(specs):
            rounds[i].append(run(spec, out_dir))
            if args.repeat == 1:
                _print(rounds[i][-1])
    rows = [_median_round(rounds[i]) for i in range(len(specs))]
    if args.repeat > 1:
        for i, row in enumerate(rows):
            row["compile_cpu_s_rounds"] = [r["compile_cpu_s"] for r in rounds[i]]
            print(f"median of {args.repeat} rounds (compile CPU s {row['compile_cpu_s_rounds']}):")
            _print(row)
    if SEED in specs:
        seed = rows[specs.index(SEED)]
        for spec, row in zip(specs, rows):
            row["compile_cpu_over_seed"] = round(row["compile_cpu_s"] / seed["compile_cpu_s"], 3)
            row["cpu_from_start_over_seed"] = round(row["cpu_s"] / seed["cpu_s"], 3)
            if spec is not SEED:
                print(f"{row['plan']}: compile CPU {row['compile_cpu_s']} s against the seed plan's {seed['compile_cpu_s']} s: "
                      f"compile_cpu_over_seed {row['compile_cpu_over_seed']}; from process start {row['cpu_s']} s against "
                      f"{seed['cpu_s']} s: cpu_from_start_over_seed {row['cpu_from_start_over_seed']}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
