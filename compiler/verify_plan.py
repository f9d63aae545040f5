"""verify-plan: execute a plan on random trainer weights and compare with vLLM's own loading, digest by digest."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..runtime import execute_local, load_plan
from ..runtime.errors import PlanMismatchError
from ..runtime.host_executor import rows_view
from ..runtime.plan_format import Plan
from ..runtime.shards import box_segments
from .frontend.trainer_formats import checkpoint_tensors
from .frontend.errors import ModelConfigError
from .frontend.vllm_model import build_model, current_platform_name, make_vllm_config, parallel_rank
from .models import config_hash, known_models, resolve_model


@dataclass(frozen=True)
class VerifyResult:
    tensors: int
    bytes: int
    mismatches: tuple[str, ...]


class _Params:
    """The slice of a model compute_tensor_digests looks at: named_parameters()."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


def check_fingerprint(plan: Plan, config_dir: Path) -> None:
    """Refuse a plan compiled for another vLLM or another config, naming what differs."""
    import vllm

    problems = []
    if plan.header["vllm_version"] != vllm.__version__:
        problems.append(f"vLLM version: plan {plan.header['vllm_version']}, installed {vllm.__version__}")
    platform = current_platform_name()
    if plan.header["inference"].get("platform") != platform:
        problems.append(f"platform: plan traced on {plan.header['inference'].get('platform')}, this is {platform}")
    if plan.header["config_sha256"] != config_hash(config_dir):
        problems.append(f"model config {config_dir / 'config.json'} differs from the one the plan was compiled for")
    if problems:
        raise PlanMismatchError("plan does not match this environment: " + "; ".join(problems) + ". Recompile it with compile-plan.")


def random_sources(plan: Plan, mask: np.ndarray, seed: int, stage_mask: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Full-size trainer tensors holding random values where the selected runs (`mask` over plan.table) read.

    Tensors are allocated with torch.empty (pages the process never touches stay unallocated),
    so sampling one expert of a 13 GB stack costs only that expert's bytes. Bytes no selected run
    reads are left unset; both the plan and vLLM read the same tensors, so they agree or differ together.
    """
    generator = torch.Generator().manual_seed(seed)
    reads: dict[int, list[tuple[int, int, int, int]]] = {}  # source -> (global offset, length, count, stride)
    runs = plan.table
    columns = [runs[c][mask].tolist() for c in ("src_rank", "src", "src_off", "length", "count", "src_stride")]
    if stage_mask is not None:  # fp8: stage runs read trainer shards too
        stage = [plan.stage[c][stage_mask].tolist() for c in ("src_rank", "src", "src_off", "length")]
        columns = [a + b for a, b in zip(columns, stage + [[1] * len(stage[0]), [0] * len(stage[0])])]
    for rank, src, off, length, count, stride in zip(*columns):
        starts, lengths, local = box_segments(plan.sources[src].shape, plan.shard_box(src, rank))
        k = int(np.searchsorted(local, off, side="right")) - 1
        if count > 1 and off + (count - 1) * stride + length <= local[k] + lengths[k]:
            reads.setdefault(src, []).append((int(starts[k] + off - local[k]), length, count, stride))
            continue
        for row in range(count):  # rows crossing a segment end: piece by piece
            at, left = off + row * stride, length
            while left > 0:
                k = int(np.searchsorted(local, at, side="right")) - 1
                take = min(left, int(local[k] + lengths[k] - at))
                reads.setdefault(src, []).append((int(starts[k] + at - local[k]), take, 1, 0))
                at, left = at + take, left - take
    out = {}
    for src in sorted(reads):
        entry = plan.sources[src]
        tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        flat = tensor.view(-1)
        for start, length, count, stride in sorted(set(reads[src])):
            target = rows_view(flat, start, length, count, stride)
            target.copy_(torch.randn(target.shape, generator=generator).to(tensor.dtype))
        out[entry.name] = tensor
    return out


def verify_plan(
    path: Path,
    *,
    model: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    max_tensor_bytes: int = 2 << 30,
    log=None,
) -> VerifyResult:
    """Run the plan rank by rank on random trainer shards; compare with vLLM's own load per inference rank."""
    log = log or (lambda msg: None)
    plan = load_plan(path)
    if model is None and plan.header["model"] not in known_models():
        raise ModelConfigError(
            f"plan {path} was compiled from a config directory named {plan.header['model']!r}; pass --model PATH"
        )
    _, config_dir = resolve_model(model or plan.header["model"])
    check_fingerprint(plan, config_dir)

    entries = list(range(len(plan.dests)))
    if sample is not None:
        # Sampled checks must fit in memory: each chosen tensor exists twice (plan and vLLM).
        small = [i for i in entries if plan.dests[i].nbytes <= max_tensor_bytes]
        if len(small) < len(entries):
            log(f"sampling among {len(small)} destination entries of at most {max_tensor_bytes} bytes "
                f"({len(entries) - len(small)} larger ones skipped; raise --max-tensor-bytes to include them)")
        entries = sorted(random.Random(seed).sample(small, min(sample, len(small))))
    chosen = np.zeros(len(plan.dests), dtype=bool)
    chosen[entries] = True
    mask = chosen[plan.table["dest"]]
    staged = np.array([chosen[e.weight] or chosen[e.scale] for e in plan.staging] + [False], dtype=bool)
    stage_mask = staged[plan.stage["stage"]]
    needed = {plan.sources[i].name for i in set(plan.table["src"][mask].tolist()) | set(plan.stage["src"][stage_mask].tolist())}
    log(f"verifying {len(entries)} of {len(plan.dests)} destination entries from {len(needed)} trainer tensors")

    full = random_sources(plan, mask, seed, stage_mask)
    shards = shard_sources(plan, full, set(plan.table["src_rank"][mask].tolist()) | set(plan.stage["src_rank"][stage_mask].tolist()))
    info = plan.header["inference"]
    quant = plan.header["quant"]
    quantization = None if quant == "none" else quant
    base = make_vllm_config(config_dir, quantization=quantization)
    vllm_config = (make_vllm_config(config_dir, tp=info["tp"], dp=info["dp"], ep=info["ep"], quantization=quantization)
                   if plan.header["dst_ranks"] > 1 else base)

    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    tensors, nbytes, mismatches = 0, 0, []
    for rank in range(plan.header["dst_ranks"]):
        names = {plan.dests[i].name for i in entries if rank in plan.dests[i].ranks}
        if not names:
            continue
        tp_rank, dp_rank = rank % info["tp"], rank // info["tp"]
        if quantization is None:
            reference = _vllm_load(vllm_config, base, plan, full, names, tp_rank, dp_rank)
            vllm_config.compilation_config.static_forward_context.clear()
            planned = _materialize(build_model(vllm_config, tp_rank=tp_rank, dp_rank=dp_rank, base_config=base), names, float("nan"))
        else:
            reference = vllm_load_quantized(vllm_config, base, plan, full, names, tp_rank, dp_rank)
            planned = {e.name: _poisoned(e) for e in plan.dests if rank in e.ranks and e.name in names}
        execute_local(plan, shards, {rank: planned}, only=names)
        expected = compute_tensor_digests(_Params(reference))
        actual = compute_tensor_digests(_Params(planned))
        mismatches += [f"{name} (inference rank {rank})" for name in sorted(expected) if expected[name] != actual.get(name)]
        tensors += len(expected)
        nbytes += sum(t.numel() * t.element_size() for t in planned.values())
        log(f"inference rank {rank}: {len(expected)} tensors compared")
    return VerifyResult(tensors, nbytes, tuple(mismatches))


def shard_sources(plan: Plan, full: dict[str, torch.Tensor], ranks: set[int]) -> dict[int, dict[str, torch.Tensor]]:
    """The given trainer ranks' local shards (contiguous copies of their boxes) of the full tensors."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rank in sorted(ranks):
        local = {}
        for i, entry in enumerate(plan.sources):
            box = plan.shard_box(i, rank)
            if entry.name not in full or box is None:
                continue
            tensor = full[entry.name]
            for dim, (lo, hi) in enumerate(box):
                tensor = tensor.narrow(dim, lo, hi - lo)
            local[entry.name] = tensor.contiguous()
        out[rank] = local
    return out


def _poisoned(entry) -> torch.Tensor:
    """A destination tensor whose bytes are all 0x7f (NaN in bf16/fp8 e4m3, a large float32): unwritten bytes show."""
    tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    tensor.view(-1).view(torch.uint8).fill_(0x7F)
    return tensor


def vllm_load_quantized(vllm_config, base, plan: Plan, full: dict[str, torch.Tensor], chosen: set[str] | None,
                        tp_rank: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """vLLM's own online quantization on CPU: load_weights, then process_weights_after_loading of every quantized layer.

    Returns the parameters named in `chosen` (every parameter when it is None).

    The model is built on the CPU with the kernel-choice stub (frontend/fp8_kernels.py), so every
    parameter of the rank is materialized: fine for small configs, too large for full GLM-5.2.
    Attention layers' own post-load step (MLA absorption, not a parameter) is not run.
    """
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing

    from .frontend.fp8_kernels import triton_fp8_kernels

    fmt = plan.header["trainer"]["format"]

    def stream():
        for entry in plan.sources:
            tensor = full.get(entry.name)
            if tensor is None:  # not read by the sampled destinations: zeros stand in
                tensor = torch.zeros(entry.shape, dtype=getattr(torch, entry.dtype))
            yield from checkpoint_tensors(fmt, entry.name, tensor)

    vllm_config.compilation_config.static_forward_context.clear()
    with triton_fp8_kernels():
        model = build_model(vllm_config, "cpu", tp_rank=tp_rank, dp_rank=dp_rank, base_config=base)
        with torch.no_grad(), parallel_rank(vllm_config, tp_rank, dp_rank):
            model.load_weights(stream())
            finalize_layerwise_processing(model, vllm_config.model_config)
            for module in model.modules():
                method = getattr(module, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    method.process_weights_after_loading(module)
    return {name: p for name, p in model.named_parameters() if chosen is None or name in chosen}


def _materialize(model: torch.nn.Module, names: set[str], fill: float) -> dict[str, torch.Tensor]:
    """Give the chosen parameters real CPU storage (filled with `fill`); the rest stay on meta.

    The Parameter objects are kept (swapped in place) so vLLM's weight_loader attributes survive.
    """
    out = {}
    for name, param in model.named_parameters():
        if name in names:
            value = fill if param.dtype.is_floating_point else (0 if fill == 0 else 1)
            real = torch.full(param.shape, value, dtype=param.dtype).as_subclass(type(param))
            real.__dict__.update(param.__dict__)
            real.requires_grad_(False)
            torch.utils.swap_tensors(param, real)
            out[name] = param
    return out


def _vllm_load(vllm_config, base, plan: Plan, full: dict[str, torch.Tensor], chosen: set[str], tp_rank: int, dp_rank: int):
    """vLLM's own load_weights of the trainer's full weights into this rank's model (ground truth)."""
    vllm_config.compilation_config.static_forward_context.clear()
    model = build_model(vllm_config, tp_rank=tp_rank, dp_rank=dp_rank, base_config=base)
    params = _materialize(model, chosen, fill=0.0)
    fmt = plan.header["trainer"]["format"]

    def stream():
        for entry in plan.sources:
            tensor = full.get(entry.name)
            if tensor is None:  # not needed by the sampled destinations: stays without data
                tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")
            yield from checkpoint_tensors(fmt, entry.name, tensor)

    with torch.no_grad(), parallel_rank(vllm_config, tp_rank, dp_rank):
        model.load_weights(stream())
    return params
