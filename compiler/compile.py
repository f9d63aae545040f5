"""compile_plan: config + layouts -> traced assignments -> passes -> plan file (the compile-plan job)."""

from __future__ import annotations

import contextlib
import gc
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .frontend.errors import ModelConfigError
from .frontend.trace import trace_load
from .frontend.trainer_formats import TRAINER_FORMATS, trainer_specs
from .frontend.vllm_model import build_model, current_platform_name, make_vllm_config
from .ir import Program
from .models import config_hash, resolve_model
from .passes.pipeline import run_passes
from .passes.verify import descriptors_lower_bound, verify
from .plan_writer import write_program

TRAINER_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
QUANTS = ("none",)


@dataclass(frozen=True)
class CompileOptions:
    model: str
    trainer_format: str = "hf"
    trainer_dtype: str = "bf16"
    quant: str = "none"
    output: Path | None = None


@dataclass
class CompileResult:
    program: Program
    path: Path
    plan_bytes: int
    timings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def default_plan_path(model: str, trainer: dict, inference: dict, quant: str) -> Path:
    """plans/<model>/<format>-<dtype>-<layout>__<inference layout>__<quant>.plan"""
    return Path("plans") / model / f"{trainer['format']}-{trainer['dtype']}-{trainer['layout']}__{inference['layout']}__{quant}.plan"


def check_options(opts: CompileOptions) -> None:
    if opts.trainer_format not in TRAINER_FORMATS:
        raise ModelConfigError(f"unknown --trainer-format {opts.trainer_format!r}; choose one of {', '.join(TRAINER_FORMATS)}")
    if opts.trainer_dtype not in TRAINER_DTYPES:
        raise ModelConfigError(f"unknown --trainer-dtype {opts.trainer_dtype!r}; choose one of {', '.join(TRAINER_DTYPES)}")
    if opts.quant not in QUANTS:
        raise ModelConfigError(f"unknown --quant {opts.quant!r}; this version compiles: {', '.join(QUANTS)}")


def compile_plan(opts: CompileOptions, *, log=None) -> CompileResult:
    """Compile and write one plan; `log(msg)` receives progress lines."""
    with gc_paused():
        return _compile(opts, log)


def _compile(opts: CompileOptions, log) -> CompileResult:
    log = log or (lambda msg: None)
    check_options(opts)
    name, config_dir = resolve_model(opts.model)
    timings: dict[str, float] = {}
    start = time.perf_counter()

    import vllm

    vllm_config = make_vllm_config(config_dir)
    model = build_model(vllm_config)
    sources = trainer_specs(config_dir, opts.trainer_format, getattr(torch, TRAINER_DTYPES[opts.trainer_dtype]))
    timings["build"] = time.perf_counter() - start

    t = time.perf_counter()
    shown = [-1]

    def progress(index: int, total: int) -> None:
        percent = 100 * index // max(total, 1)
        if percent // 10 != shown[0] // 10:
            shown[0] = percent
            log(f"tracing {name}: {percent}% of traced trainer tensors")

    assignments, dests = trace_load(model, sources, opts.trainer_format, progress)
    timings["trace"] = time.perf_counter() - t

    trainer = {"format": opts.trainer_format, "dtype": opts.trainer_dtype, "layout": "1rank"}
    inference = {"layout": "tp1", "tp": 1, "dp": 1, "ep": False, "platform": current_platform_name()}
    program = Program(
        sources=tuple(sources),
        dests=tuple(dests),
        assignments=tuple(assignments),
        meta={
            "vllm_version": vllm.__version__,
            "model": name,
            "config_sha256": config_hash(config_dir),
            "architecture": vllm_config.model_config.architectures[0],
            "trainer": trainer,
            "inference": inference,
            "quant": opts.quant,
            "src_ranks": 1,
            "dst_ranks": 1,
        },
    )
    t = time.perf_counter()
    pass_timings: dict[str, float] = {}
    lowered = run_passes(program, timings=pass_timings, stop_before="coalesce")
    runs_before = len(lowered.runs)
    lower_bound = descriptors_lower_bound(lowered.runs)
    compiled = run_passes(lowered, timings=pass_timings, start_at="coalesce")
    coverage = verify(compiled)
    timings["passes"] = time.perf_counter() - t
    timings.update({f"pass.{k}": v for k, v in pass_timings.items()})

    stats = {
        "assignments": len(assignments),
        "runs_before_coalesce": runs_before,
        "descriptors": len(compiled.runs),
        "descriptors_lower_bound": lower_bound,
        "dst_coverage": coverage.fraction,
    }
    compiled.meta["stats"] = {"assignments": len(assignments), "runs_before_coalesce": runs_before}
    path = opts.output or default_plan_path(name, trainer, inference, opts.quant)
    t = time.perf_counter()
    size = write_program(compiled, path)
    timings["write"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - start
    stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return CompileResult(compiled, path, size, timings, stats)


@contextlib.contextmanager
def gc_paused():
    """Pause the cyclic GC: the IR is acyclic and large, and gen-2 scans of it dominate otherwise."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
