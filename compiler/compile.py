"""compile_plan: config + layouts -> traced assignments -> passes -> plan file (the compile-plan job)."""

from __future__ import annotations

import dataclasses
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from weightplan.runtime.plan.header import DraftHeader, EplbHeader, InferenceHeader, PlanStats, TrainerHeader
from .frontend.draft import DRAFT_METHOD, check_draft, check_draft_architecture, draft_trainer
from .frontend.errors import ModelConfigError
from .frontend.lora_trace import LoraRankTracer, LoraSpec, check_lora
from .frontend.rank_models import RankTracer
from .frontend.trainer_adapter import check_adapter_spec, load_adapter
from .frontend.trainer_formats import Conversion, TrainerFormat, load_trainer_model
from .frontend.vllm_model import build_model, draft_config, make_vllm_config
from .frontend.cuda_platform import check_moe_backend, platform_record, traced_fp8_kernels
from .frontend.vllm_patches import host_independent, installed_vllm, trace_platform
from .gc_pause import gc_paused
from .layouts import (ExplicitTrainer, InferenceLayout, TrainerLayout, check_trainer_experts, check_trainer_stages, parse_inference,
                      parse_trainer)
from .ir import PlanOrigin, Program, TensorEntry
from .models import config_hash, load_config_json, resolve_model
from .passes.pipeline import Stage, join_ranks, run_stage
from .passes.descriptor_counts import descriptors_lower_bound, descriptors_posted
from .plan_writer import write_program
from .quant_compile import QuantMode, quant_mode
from .timing import add, clock, phase

TRAINER_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class CompileOptions:
    """What compile-plan is asked, as its command line spells it (check_inputs parses it once)."""

    model: str
    trainer_format: str = "hf"
    trainer_dtype: str = "bf16"
    quant: str = "none"
    output: Path | None = None
    trainer: str = "fsdp=1"
    inference: str = "tp=1"
    trainer_layout: Path | None = None
    check_passes: bool = False  # verify the program after every pass, not only the coverage proof at the end
    trainer_adapter: str | None = None  # module:callable mapping a non-transformers trainer's tensors to checkpoint ones
    draft: bool = False  # the MTP speculative-decoding draft model's plan (frontend/draft.py), not the target's
    lora: str | None = None  # --lora: a LoRA adapter's plan into one slot of vLLM's LoRA buffers (frontend/lora_trace.py)
    scale_rounding: str | None = None  # --scale-rounding of an fp8 plan: cuda (None: the default) or ieee
    moe_backend: str | None = None  # --moe-backend of the GPU engines a cuda plan is for (None: vLLM's choice)


@dataclass
class CompileResult:
    program: Program
    path: Path
    plan_bytes: int
    timings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def default_plan_path(model: str, trainer: TrainerHeader, inference: InferenceHeader, quant: str) -> Path:
    """plans/<model>/[cuda-<device>/][mtp-][loraR-]<format>-<dtype>-<trainer layout>__<inference layout>__<quant>.plan
    (cuda-<device>/: a plan for GPU engines, compile-plan --platform cuda; mtp-: a draft plan; loraR-: a rank-R adapter's)"""
    draft = f"{inference.draft.method}-" if inference.draft is not None else ""
    draft += f"lora{inference.lora.rank}-" if inference.lora is not None else ""
    folder = Path("plans") / model
    if inference.platform == "cuda":
        folder /= f"cuda-{(inference.vllm_host or {}).get('device', 'unknown')}"
    return folder / f"{draft}{trainer.format}-{trainer.dtype}-{trainer.token}__{inference.token}__{quant}.plan"


def check_options(opts: CompileOptions) -> tuple[TrainerFormat, QuantMode]:
    """The trainer tensors' format (the adapter's, or --trainer-format) and the --quant mode; refuses unknown values."""
    fmt = TrainerFormat.parse(opts.trainer_format)
    if opts.trainer_adapter is not None:
        check_adapter_spec(opts.trainer_adapter)
        if fmt is not TrainerFormat.HF:
            raise ModelConfigError("pass either --trainer-format or --trainer-adapter (the adapter names the trainer's tensors)")
        fmt = TrainerFormat.ADAPTER
    if opts.trainer_dtype not in TRAINER_DTYPES:
        raise ModelConfigError(f"unknown --trainer-dtype {opts.trainer_dtype!r}; choose one of {', '.join(TRAINER_DTYPES)}")
    return fmt, quant_mode(opts.quant, opts.scale_rounding)


@dataclass(frozen=True)
class CompileSettings:
    """Everything a compile reads, parsed once from CompileOptions and checked against the model config before vLLM
    is imported (check_inputs): _compile reads nothing else."""

    trainer_format: TrainerFormat
    quant: QuantMode
    trainer_layout: TrainerLayout | ExplicitTrainer
    inference: InferenceLayout
    name: str
    config_dir: Path
    trainer_dtype: str  # a TRAINER_DTYPES key
    trainer_adapter: str | None
    output: Path | None
    check_passes: bool
    draft: bool
    lora: LoraSpec | None = None
    moe_backend: str | None = None

    @property
    def trainer_torch_dtype(self) -> torch.dtype:
        return getattr(torch, TRAINER_DTYPES[self.trainer_dtype])


def check_output(path: Path | None) -> None:
    """Refuse an output path a plan cannot be written to, before the compile spends minutes on it."""
    if path is None:
        return
    if not str(path).strip():
        raise ModelConfigError("-o/--output is empty; give a plan file path")
    path = Path(path)
    try:
        if path.is_dir():
            raise ModelConfigError(f"-o/--output {path} is a directory; give a plan file path inside it")
        if path.exists() and not path.is_file():
            raise ModelConfigError(f"-o/--output {path} exists and is not a regular file")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
        if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or str(path.absolute()).startswith("/proc/"):
            raise ModelConfigError(f"-o/--output {path}: cannot create files under {parent}")
        # The writer's temporary name (runtime/files.py: write_atomically) is the longest name it creates.
        longest = max([len(part.encode()) for part in path.parent.parts] + [len(f".{path.name}.12345678.tmp".encode())])
        if longest > os.pathconf(parent, "PC_NAME_MAX"):
            raise ModelConfigError(f"-o/--output {str(path)[:80]}...: a file name is longer than the "
                                   f"{os.pathconf(parent, 'PC_NAME_MAX')} bytes {parent} allows (with the writer's temporary suffix)")
        if parent == path.absolute().parent:  # try creating (and remove) a file there: /sys and the like refuse only then
            probe, name = tempfile.mkstemp(prefix=".weightplan-probe.", dir=parent)
            os.close(probe)
            os.unlink(name)
    except OSError as exc:
        raise ModelConfigError(f"-o/--output {str(path)[:80]}: cannot create files there: {exc.strerror or exc}") from None


def check_inputs(opts: CompileOptions) -> CompileSettings:
    fmt, quant = check_options(opts)
    check_output(opts.output)
    trainer_layout = parse_trainer(opts.trainer, opts.trainer_layout, fmt)
    inference = parse_inference(opts.inference)
    name, config_dir = resolve_model(opts.model)
    config = load_config_json(config_dir)
    inference.check(config)
    if inference.eplb is not None:
        check_eplb_options(opts, inference)
    check_trainer_experts(trainer_layout, config)
    trainer_layout = check_trainer_stages(trainer_layout, config)
    if opts.draft:
        check_draft(config, config_dir / "config.json", fmt=fmt, quant=quant)
    lora = check_lora(opts, fmt, quant) if opts.lora is not None else None
    moe_backend = check_moe_backend(opts.moe_backend) if opts.moe_backend is not None else None
    return CompileSettings(fmt, quant, trainer_layout, inference, name, config_dir, opts.trainer_dtype, opts.trainer_adapter,
                           opts.output, opts.check_passes, opts.draft, lora, moe_backend)


def compile_plan(opts: CompileOptions, *, log=None) -> CompileResult:
    """Compile and write one plan; `log(msg)` receives progress lines."""
    installed_vllm("compile-plan")
    settings = check_inputs(opts)
    trainer_model = None if settings.lora else trainer_tensors(settings.config_dir, settings.trainer_dtype, settings.trainer_adapter)
    with gc_paused(), host_independent():
        return _compile(settings, trainer_model, log or (lambda msg: None))


def _compile(settings: CompileSettings, trainer_model, log) -> CompileResult:
    trainer_layout, inference, name, config_dir = settings.trainer_layout, settings.inference, settings.name, settings.config_dir
    fmt, quant = settings.trainer_format, settings.quant
    timings: dict[str, float] = {"setup": 0.0, "build": 0.0, "trace": 0.0, "passes": 0.0}
    start, start_cpu = time.perf_counter(), time.process_time()

    import vllm

    engine = {"quantization": quant.vllm_quantization, "draft": settings.draft, "moe_backend": settings.moe_backend}
    base = make_vllm_config(config_dir, **engine)
    vllm_config = (make_vllm_config(config_dir, tp=inference.tp, dp=inference.dp, ep=inference.ep, pp=inference.pp,
                                    eplb=inference.eplb, **engine)
                   if inference.ranks > 1 else base)
    draft = None
    if settings.draft:  # the trainer's MTP tensors; the draft's own tensors are read off vLLM's one-rank draft
        check_draft_architecture(draft_config(base).architectures[0], config_dir / "config.json")
        one_rank = build_model(base)
        trainer_model = draft_trainer(trainer_model, load_config_json(config_dir), one_rank,
                                      settings.trainer_torch_dtype)
        draft = DraftHeader(DRAFT_METHOD, tuple(one_rank.shared_with_target))
        del one_rank
    lora = LoraRankTracer(vllm_config, base, inference, settings.lora, settings.trainer_torch_dtype) \
        if settings.lora is not None else None
    sources = lora.sources if lora is not None else trainer_model.specs(fmt)
    trainer_layout = trainer_layout.bind(sources)
    add(timings, "setup", (start, start_cpu))  # importing vLLM, the engine configs, the trainer table

    per_rank = []
    chains: tuple = ()
    assignments_total = 0
    quant_hooks = quant.hooks()
    ranks = lora or RankTracer(vllm_config, base, inference, sources, Conversion(trainer_model, fmt), timings, quant_hooks=quant_hooks)
    unloaded: dict[tuple, list[int]] = {}  # (name, shape, dtype) -> the inference ranks where vLLM's load never writes it
    for rank in range(inference.ranks):
        load = ranks.trace(rank, _progress(log, name, rank, inference.ranks))
        for entry in load.unloaded:
            unloaded.setdefault((entry.name, entry.shape, entry.dtype), []).append(rank)
        with phase(timings, "passes"):
            traced = Program(tuple(sources), tuple(load.dests), tuple(load.assignments), cast_chains=chains,
                             layer_reuse=load.layer_reuse, quant_targets=quant_hooks.targets() if quant_hooks else ())
            lowered = run_stage(Stage.PER_RANK, traced, check_each=settings.check_passes)
            chains = lowered.cast_chains
            per_rank.append(dataclasses.replace(lowered, assignments=(), copies=()))  # keep only the runs
            assignments_total += len(load.assignments) + load.reused_assignments
            del load, traced, lowered

    started = clock()
    trainer = TrainerHeader(fmt.value, settings.trainer_dtype, trainer_layout.token, trainer_layout.classes, settings.trainer_adapter or None,
                            pp=getattr(settings.trainer_layout, "pp", 1) if getattr(settings.trainer_layout, "pp", 1) > 1 else None)
    joined = join_ranks(per_rank, chains, check_each=settings.check_passes)
    inference_meta = InferenceHeader(inference.token, inference.tp, inference.dp, inference.ep, trace_platform(),
                                     platform_record(vllm_config), inference.gpus_per_node or None, draft, pp=inference.pp if inference.pp > 1 else None,
                                     lora=lora.spec.header(lora.targets) if lora is not None else None,
                                     eplb=eplb_header(inference, config_dir, ranks, joined.dests)
                                     if inference.eplb is not None else None)
    origin = PlanOrigin(vllm_version=vllm.__version__, model=name, config_sha256=config_hash(config_dir),
                        architecture=(draft_config(base) or base.model_config).architectures[0], trainer=trainer, inference=inference_meta,
                        quant=quant.name, src_ranks=trainer_layout.ranks, dst_ranks=inference.ranks)
    program = dataclasses.replace(
        joined, origin=origin, trainer_layout=trainer_layout,
        quant_targets=quant.targets(quant_hooks),
        derived=tuple(quant_hooks.derived if quant_hooks else ranks.derived or ()),
        unloaded=tuple(TensorEntry(n, shape, dtype, ranks=tuple(r)) for (n, shape, dtype), r in sorted(unloaded.items())),
        kernel_layout=quant.kernel_layout(traced_fp8_kernels(vllm_config)))
    before_coalesce = {}
    compiled = run_stage(Stage.WHOLE_PLAN, program, check_each=settings.check_passes, observe=_before_coalesce(before_coalesce))
    compiled = run_stage(Stage.EPLB, compiled, check_each=settings.check_passes)
    compiled = run_stage(Stage.QUANT, compiled, check_each=settings.check_passes)
    compiled = run_stage(Stage.FANOUT, dataclasses.replace(compiled, gpus_per_node=inference.gpus_per_node),
                         check_each=settings.check_passes)
    choice = compiled.source_choice
    header_stats = PlanStats(assignments_total, before_coalesce["runs"],
                             choice if choice is not None and choice.shared_bytes else None)  # absent: other plans keep their bytes
    compiled = dataclasses.replace(compiled, stats=header_stats)
    add(timings, "passes", started)

    stats = {
        "assignments": assignments_total,
        "runs_before_coalesce": before_coalesce["runs"],
        "descriptors": descriptors_posted(compiled.runs, compiled.dests),
        "descriptors_lower_bound": before_coalesce["lower_bound"],
        "dst_coverage": compiled.coverage.fraction,
        **ranks.stats,
    }
    if header_stats.source_choice is not None:
        stats["source_choice"] = header_stats.source_choice.to_json()
    path = settings.output or default_plan_path(name, trainer, inference_meta, quant.plan_token)
    with phase(timings, "write"):
        size = write_program(compiled, path)
    timings["total"] = time.perf_counter() - start
    timings["total_cpu"] = time.process_time() - start_cpu
    stats["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return CompileResult(compiled, path, size, timings, stats)


def check_eplb_options(opts: CompileOptions, inference: InferenceLayout) -> None:
    """Refuse in one line what an EPLB plan (`--inference ...,eplb=R`) cannot be compiled with yet, or where."""
    where = f"--inference eplb={inference.eplb}"
    inference.check_platform(trace_platform())
    if opts.quant != "none":
        raise ModelConfigError(f"{where} with --quant {opts.quant} is not supported yet: EPLB plans are unquantized "
                               "(docs/cuda.md, EPLB plans)")
    if opts.draft or opts.lora is not None:
        raise ModelConfigError(f"{where} with {'--draft' if opts.draft else '--lora'} is not supported yet: EPLB plans "
                               "are the target model's own weights (docs/cuda.md, EPLB plans)")


def eplb_header(inference: InferenceLayout, config_dir: Path, ranks: RankTracer, dests) -> EplbHeader:
    """The header's EPLB record: the routed and redundant experts, and per MoE layer (vLLM's order) the plan
    destinations whose dim 0 is that layer's local physical slot (what RoutedExperts.get_expert_weights moves)."""
    planned = {entry.name for entry in dests}
    kept = tuple(tuple(name for name in layer if name in planned) for layer in ranks.eplb_layers or ())
    if not kept or not all(kept) or not ranks.logical_experts:
        raise ModelConfigError(f"--inference eplb={inference.eplb}: vLLM built no MoE layer whose expert tensors the plan "
                               f"writes ({config_dir / 'config.json'}); EPLB plans need routed experts")
    return EplbHeader(ranks.logical_experts, inference.eplb, kept)


def _before_coalesce(into: dict):
    """An observer recording, once split_shards has run, the runs and the fewest descriptors they could become."""

    def observe(name: str, program: Program, seconds: float) -> None:
        if name != "split_shards":
            return
        # Runs into quantized tensors become stage runs (their own table), not descriptors: bound the rest.
        quantized = program.quantized()
        posted = np.array([spec.name not in quantized for spec in program.dests] or [True])[program.runs.dest]
        into["runs"] = len(program.runs)
        into["lower_bound"] = descriptors_lower_bound(program.runs.take(np.flatnonzero(posted)), program.dests)

    return observe


def trainer_tensors(config_dir: Path, dtype: str, adapter: str | None):
    """The trainer's tensor table and checkpoint conversion: transformers' model, or the named adapter's."""
    if adapter is not None:
        return load_adapter(adapter, config_dir, getattr(torch, TRAINER_DTYPES[dtype]))
    return load_trainer_model(config_dir, getattr(torch, TRAINER_DTYPES[dtype]))


def _progress(log, name: str, rank: int, ranks: int):
    shown = [-1]
    where = f" rank {rank + 1}/{ranks}" if ranks > 1 else ""

    def progress(index: int, total: int) -> None:
        percent = 100 * index // max(total, 1)
        if percent // 10 != shown[0] // 10:
            shown[0] = percent
            log(f"tracing {name}{where}: {percent}% of traced trainer tensors")

    return progress
