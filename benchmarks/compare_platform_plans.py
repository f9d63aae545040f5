"""What differs between each checked-in cuda plan and the cpu plan of the same topology: parameters, shapes, runs, bytes.

Usage: python benchmarks/compare_platform_plans.py [--device h200]  (prints one JSON line per plan pair, then a summary)
Reads plan files only (no vLLM needed); the pairs are compiler/make_plans.py's CHECKED_IN_CUDA and their CHECKED_IN twins.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from weightplan.compiler.compile import CompileOptions, default_plan_path
from weightplan.compiler.frontend.trainer_formats import TrainerFormat
from weightplan.compiler.layouts import parse_inference, parse_trainer
from weightplan.compiler.make_plans import CHECKED_IN, CHECKED_IN_CUDA
from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.quant_compile import quant_mode
from weightplan.runtime import load_plan

ROOT = Path(__file__).resolve().parents[1]
SAME_TOPOLOGY = ("model", "trainer_format", "trainer_dtype", "trainer", "inference", "quant")


def plan_path(options: CompileOptions, device: str | None) -> Path:
    """The checked-in file of `options` (compile.default_plan_path, from the layouts' own tokens) for the cpu (device
    None) or a cuda device."""
    fmt = TrainerFormat.parse(options.trainer_format)
    trainer = SimpleNamespace(format=fmt.value, dtype=options.trainer_dtype,
                              token=parse_trainer(options.trainer, None, fmt).token)
    inference = SimpleNamespace(token=parse_inference(options.inference).token, draft=None, lora=None,
                                platform="cuda" if device else "cpu", vllm_host={"device": device})
    return ROOT / default_plan_path(options.model, trainer, inference, quant_mode(options.quant).plan_token)


def twin(options: CompileOptions) -> CompileOptions:
    """The cpu plan compiled for the same topology and quantization."""
    key = tuple(getattr(options, f) for f in SAME_TOPOLOGY)
    return next(o for o in CHECKED_IN if tuple(getattr(o, f) for f in SAME_TOPOLOGY) == key)


def run_rows(plan) -> np.ndarray:
    """The plan's runs as rows that name their tensors and cast chain (the two traces may number them differently:
    vLLM's CUDA model classes register some modules in another order), sorted."""
    names = sorted({e.name for e in plan.sources} | {e.name for e in plan.dests})
    ids = {name: i for i, name in enumerate(names)}
    chains = sorted({repr(c) for c in plan.cast_chains})
    table = plan.table
    columns = [np.array([ids[plan.sources[i].name] for i in range(len(plan.sources))])[table.src],
               np.array([ids[plan.dests[i].name] for i in range(len(plan.dests))])[table.dest],
               np.array([chains.index(repr(c)) for c in plan.cast_chains])[table.wire]]
    columns += [getattr(table, f.name) for f in dataclasses.fields(table) if f.name not in ("src", "dest", "wire")]
    rows = np.stack(columns, axis=1)
    return rows[np.lexsort(rows.T[::-1])]


def compare(cpu_path: Path, cuda_path: Path) -> dict:
    cpu, cuda = load_plan(cpu_path), load_plan(cuda_path)
    by_name = ({e.name: e for e in cpu.dests}, {e.name: e for e in cuda.dests})
    shared = by_name[0].keys() & by_name[1].keys()
    differ = sorted(n for n in shared if (by_name[0][n].shape, by_name[0][n].dtype, by_name[0][n].ranks)
                    != (by_name[1][n].shape, by_name[1][n].dtype, by_name[1][n].ranks))
    same_runs = len(cpu.table) == len(cuda.table) and np.array_equal(run_rows(cpu), run_rows(cuda))
    s_cpu, s_cuda = summarize(cpu), summarize(cuda)
    figures = ("dst_tensors", "dst_bytes", "wire_bytes", "descriptors", "descriptors_stored")
    layout = lambda plan: plan.header.quant_layout and {"linear": plan.header.quant_layout.linear, "moe": plan.header.quant_layout.moe}
    return {
        "cpu_plan": str(cpu_path.relative_to(ROOT)), "cuda_plan": str(cuda_path.relative_to(ROOT)),
        "parameters_only_cpu": sorted(by_name[0].keys() - shared), "parameters_only_cuda": sorted(by_name[1].keys() - shared),
        "parameters_differing": differ[:20], "parameters_differing_count": len(differ), "parameters_shared": len(shared),
        "runs": {"cpu": len(cpu.table), "cuda": len(cuda.table)}, "runs_identical_by_name": same_runs,
        "dest_order_identical": [e.name for e in cpu.dests] == [e.name for e in cuda.dests],
        **{name: {"cpu": s_cpu[name], "cuda": s_cuda[name]} for name in figures},
        "plan_file_bytes": {"cpu": cpu_path.stat().st_size, "cuda": cuda_path.stat().st_size},
        "fingerprints_differ": cpu.header.fingerprint != cuda.header.fingerprint,
        "header": {"cpu": {"vllm": cpu.header.vllm_version, "profile": cpu.header.inference.vllm_host, "fp8_kernels": layout(cpu)},
                   "cuda": {"vllm": cuda.header.vllm_version, "profile": cuda.header.inference.vllm_host,
                            "fp8_kernels": layout(cuda)}},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h200", help="the cuda plans' device folder (plans/<model>/cuda-<device>/)")
    args = parser.parse_args(argv)
    rows = []
    for options in CHECKED_IN_CUDA:
        cpu_path, cuda_path = plan_path(twin(options), None), plan_path(options, args.device)
        missing = [str(p.relative_to(ROOT)) for p in (cpu_path, cuda_path) if not p.is_file()]
        if missing:
            print(f"error: no plan file {', '.join(missing)} (make plan; the cuda plans need make venv-cuda)", file=sys.stderr)
            return 2
        rows.append(compare(cpu_path, cuda_path))
        print(json.dumps(rows[-1], sort_keys=True))
    same = all(not r["parameters_only_cpu"] and not r["parameters_only_cuda"] and not r["parameters_differing_count"]
               and r["runs_identical_by_name"] for r in rows)
    print(json.dumps({"pairs": len(rows), "same_parameters_and_runs": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
