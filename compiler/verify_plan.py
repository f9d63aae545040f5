"""verify-plan: execute a plan on random trainer weights and compare with vLLM's own loading, digest by digest."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from weightplan.runtime import execute_local, load_plan
from weightplan.runtime.checks import named_tensors, persistent_buffers
from weightplan.runtime.errors import PlanMismatchError
from weightplan.runtime.fp8.rounding import ScaleRounding
from weightplan.runtime.host.executor import rows_view
from weightplan.runtime.plan.format import Plan
from weightplan.runtime.tables.fanout import second_hops
from weightplan.runtime.layout.shards import box_segments
from .cuda_arithmetic import CudaArithmetic
from .frontend.trainer_formats import Conversion, TrainerFormat
from .frontend.errors import ModelConfigError
from .frontend.vllm_model import build_model, make_vllm_config
from .frontend.cuda_platform import device_record, pinned_profile
from .frontend.vllm_patches import (HOST_PROFILE, fp8_post_load, host_independent, installed_vllm, parallel_rank, trace_platform,
                                    triton_fp8_kernels)
from .models import config_hash, known_models, resolve_model
from .quant_compile import quant_mode
from .digests import compare_digests, poisoned
from .verify_lora import verify_lora


@dataclass(frozen=True)
class VerifyResult:
    tensors: int
    bytes: int
    mismatches: tuple[str, ...]
    compared: tuple[str, ...] = ()  # "name (inference rank k)" of every tensor compared
    unloaded: int = 0  # parameters the plan lists as never written that vLLM's load was seen to leave untouched


def check_fingerprint(plan: Plan, config_dir: Path) -> None:
    """Refuse a plan compiled for another vLLM or another config, naming what differs."""
    import vllm

    problems = []
    if plan.header.vllm_version != vllm.__version__:
        problems.append(f"vLLM version: plan {plan.header.vllm_version}, installed {vllm.__version__}")
    platform = trace_platform()
    if plan.header.inference.platform != platform:
        problems.append(f"platform: plan traced on {plan.header.inference.platform}, this is {platform}")
    pinned = plan.header.inference.vllm_host
    profile = pinned_profile() if platform == "cuda" else None
    if profile is None and pinned != HOST_PROFILE:
        problems.append(f"vLLM host choices: plan compiled with {pinned}, this compiler pins {HOST_PROFILE}")
    if profile is not None and {k: (pinned or {}).get(k) for k in device_record(profile)} != device_record(profile):
        problems.append(f"device: plan compiled for {pinned}, this verifies on {device_record(profile)}")
    if plan.header.config_sha256 != config_hash(config_dir):
        problems.append(f"model config {config_dir / 'config.json'} differs from the one the plan was compiled for")
    if problems:
        raise PlanMismatchError("plan does not match this environment: " + "; ".join(problems) + ". Recompile it with compile-plan.")


Read = tuple[int, int, int, int, int]  # (global start, local start, length, count, stride) in elements


def source_reads(plan: Plan, mask: np.ndarray, stage_mask: np.ndarray | None = None) -> dict[tuple[int, int], list[Read]]:
    """(trainer rank, source) -> the element rows the selected runs (`mask` over plan.table) and stage runs read.

    A strided read stays one row set when it lies in one contiguous segment of the rank's box (the
    same stride then holds in the full tensor and in the shard); otherwise it is cut into pieces.
    """
    reads: dict[tuple[int, int], set[Read]] = {}
    runs = plan.table
    columns = [runs[c][mask].tolist() for c in ("src_rank", "src", "src_off", "length", "count", "src_stride")]
    if stage_mask is not None:  # fp8: stage runs read trainer shards too
        stage = [plan.stage[c][stage_mask].tolist() for c in ("src_rank", "src", "src_off", "length")]
        columns = [a + b for a, b in zip(columns, stage + [[1] * len(stage[0]), [0] * len(stage[0])])]
    for rank, src, off, length, count, stride in zip(*columns):
        starts, lengths, local = box_segments(plan.sources[src].shape, plan.shard_box(src, rank))
        out = reads.setdefault((rank, src), set())
        k = int(np.searchsorted(local, off, side="right")) - 1
        if count > 1 and off + (count - 1) * stride + length <= local[k] + lengths[k]:
            out.add((int(starts[k] + off - local[k]), off, length, count, stride))
            continue
        for row in range(count):  # rows crossing a segment end: piece by piece
            at, left = off + row * stride, length
            while left > 0:
                k = int(np.searchsorted(local, at, side="right")) - 1
                take = min(left, int(local[k] + lengths[k] - at))
                out.add((int(starts[k] + at - local[k]), at, take, 1, 0))
                at, left = at + take, left - take
    return {key: sorted(rows) for key, rows in reads.items()}


def random_sources(plan: Plan, reads: dict[tuple[int, int], list[Read]], seed: int) -> dict[str, torch.Tensor]:
    """Full-size trainer tensors holding random values where `reads` (from source_reads) say the selected runs read.

    Tensors are allocated with torch.empty (pages the process never touches stay unallocated),
    so sampling one expert of a 13 GB stack costs only that expert's bytes. Bytes no selected run
    reads are left unset; both the plan and vLLM read the same tensors, so they agree or differ together.
    """
    generator = torch.Generator().manual_seed(seed)
    by_source: dict[int, set[tuple[int, int, int, int]]] = {}
    for (_, src), rows in reads.items():
        by_source.setdefault(src, set()).update((start, length, count, stride) for start, _, length, count, stride in rows)
    out = {}
    for src in sorted(by_source):
        entry = plan.sources[src]
        tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
        flat = tensor.view(-1)
        for start, length, count, stride in sorted(by_source[src]):
            target = rows_view(flat, start, length, count, stride)
            target.copy_(torch.randn(target.shape, generator=generator).to(tensor.dtype))
        out[entry.name] = tensor
    return out


def sampled_shards(plan: Plan, full: dict[str, torch.Tensor], reads: dict[tuple[int, int], list[Read]]) -> dict[int, dict[str, torch.Tensor]]:
    """The trainer ranks' local shards holding only the bytes `reads` lists (copied from `full`); the rest stays unset.

    Unlike shard_sources, pages no read touches are never allocated, so sampling a few experts of a
    full-size stacked tensor costs their bytes, not the whole box's.
    """
    out: dict[int, dict[str, torch.Tensor]] = {}
    for (rank, src), rows in sorted(reads.items()):
        entry = plan.sources[src]
        shard = torch.empty(plan.local_shape(src, rank), dtype=getattr(torch, entry.dtype))
        source, local = full[entry.name].view(-1), shard.view(-1)
        for start, at, length, count, stride in rows:
            rows_view(local, at, length, count, stride).copy_(rows_view(source, start, length, count, stride))
        out.setdefault(rank, {})[entry.name] = shard
    return out


def verify_plan(
    path: Path,
    *,
    model: str | None = None,
    sample: int | None = None,
    seed: int = 0,
    max_tensor_bytes: int = 2 << 30,
    ranks: Collection[int] | None = None,
    log=None,
) -> VerifyResult:
    """Run the plan rank by rank on random trainer shards; compare with vLLM's own load per inference rank.

    `ranks` limits the check to those inference ranks (and the sample to the entries they hold).
    """
    log = log or (lambda msg: None)
    installed_vllm("verify-plan")
    plan = load_plan(path)
    if model is None and plan.header.model not in known_models():
        raise ModelConfigError(
            f"plan {path} was compiled from a config directory named {plan.header.model!r}; pass --model PATH"
        )
    _, config_dir = resolve_model(model or plan.header.model)
    check_fingerprint(plan, config_dir)
    quant = quant_mode(plan.header.quant)
    n_ranks = plan.header.dst_ranks
    ranks = set(range(n_ranks)) if ranks is None else set(ranks)
    outside = sorted(ranks - set(range(n_ranks)))
    if not ranks or outside:
        raise PlanMismatchError(f"inference ranks {outside} are not among the plan's {n_ranks} ranks (0..{n_ranks - 1})"
                                if outside else f"no inference rank to verify: pick some of 0..{n_ranks - 1}")

    entries = [i for i, e in enumerate(plan.dests) if ranks & set(e.ranks)]
    if sample is not None:
        # Sampled checks must fit in memory: each chosen tensor exists twice (plan and vLLM).
        small = [i for i in entries if plan.dests[i].nbytes <= max_tensor_bytes]
        if len(small) < len(entries):
            log(f"sampling among {len(small)} destination entries of at most {max_tensor_bytes} bytes "
                f"({len(entries) - len(small)} larger ones skipped; raise --max-tensor-bytes to include them)")
        if not small:
            raise PlanMismatchError(f"no destination tensor of at most {max_tensor_bytes} bytes to sample; raise --max-tensor-bytes")
        entries = sorted(random.Random(seed).sample(small, min(sample, len(small))))
        if quant.quantizes:
            entries = whole_modules(plan, entries, ranks)
    chosen = np.zeros(len(plan.dests), dtype=bool)
    chosen[entries] = True
    mask = chosen[plan.table["dest"]]
    staged = np.array([chosen[e.weight] or chosen[e.scale] for e in plan.staging] + [False], dtype=bool)
    stage_mask = staged[plan.stage["stage"]]
    reads = source_reads(plan, mask, stage_mask)
    log(f"verifying {len(entries)} of {len(plan.dests)} destination entries from {len({src for _, src in reads})} trainer tensors")
    if sample is not None:
        log("sampled: " + ", ".join(sorted({plan.dests[i].name for i in entries})))

    full = random_sources(plan, reads, seed)
    shards = sampled_shards(plan, full, reads)
    info = plan.header.inference
    if info.lora is not None:  # an adapter plan: vLLM's adapter load of a PEFT directory is the reference
        tensors, nbytes, mismatches, compared = verify_lora(plan, config_dir, full, shards, {plan.dests[i].name for i in entries},
                                                            ranks, make_vllm_config, log)
        return VerifyResult(tensors, nbytes, tuple(mismatches), tuple(compared))
    draft = info.draft is not None  # a draft plan (compile-plan --draft): vLLM's MTP draft model is the reference
    moe_backend = (info.vllm_host or {}).get("moe_backend_setting") if info.platform == "cuda" else None
    engine = {"quantization": quant.vllm_quantization, "draft": draft, "moe_backend": moe_backend}
    base = make_vllm_config(config_dir, **engine)
    eplb = info.eplb.redundant_experts if info.eplb is not None else None  # an EPLB plan: vLLM's engine with --enable-eplb
    vllm_config = (make_vllm_config(config_dir, tp=info.tp, dp=info.dp, ep=info.ep, pp=info.pp or 1, eplb=eplb, **engine)
                   if plan.header.dst_ranks > 1 else base)

    tensors, nbytes, mismatches, compared, unloaded = 0, 0, [], [], 0
    for group in execution_groups(plan, ranks):
        chosen_names = {plan.dests[i].name for i in entries if set(plan.dests[i].ranks) & set(group)}
        planned_of = {}
        for rank in group:
            names = {e.name for e in plan.dests if rank in e.ranks and e.name in chosen_names}
            if not names:
                continue
            at = info.rank_coords(rank)
            if not quant.quantizes:
                planned_of[rank] = _materialize(build_model(vllm_config, tp_rank=at.tp, dp_rank=at.dp, pp_rank=at.pp, base_config=base),
                                                names, float("nan"))
            else:
                planned_of[rank] = {e.name: poisoned(e) for e in plan.dests if rank in e.ranks and e.name in names}
        execute_local(plan, shards, planned_of, only=chosen_names)
        for rank, planned in planned_of.items():
            if rank not in ranks:  # a puller executed only for the peers of its node it serves
                continue
            at = info.rank_coords(rank)
            if not quant.quantizes:
                untouched = {e.name for e in plan.unloaded if rank in e.ranks}
                reference, written = _vllm_load(vllm_config, base, plan, full, set(planned), at.tp, at.dp, untouched, pp_rank=at.pp)
                mismatches += [f"{name} (inference rank {rank}, listed as never written)" for name in sorted(written)]
                unloaded += len(untouched) - len(written)
            else:
                reference = vllm_load_quantized(vllm_config, base, plan, full, set(planned), at.tp, at.dp, pp_rank=at.pp)
            differ, same = compare_digests(reference, planned, rank)
            mismatches += differ
            compared += same
            tensors += len(same)
            nbytes += sum(t.numel() * t.element_size() for t in planned.values())
            log(f"inference rank {rank}: {len(same)} tensors compared")
    if not tensors:
        raise PlanMismatchError(f"nothing was compared: inference ranks {sorted(ranks)} hold none of the chosen tensors")
    return VerifyResult(tensors, nbytes, tuple(mismatches), tuple(compared), unloaded)


def execution_groups(plan: Plan, ranks: Collection[int]) -> list[tuple[int, ...]]:
    """The inference ranks to execute together: each rank alone, or with fan-out each node's ranks among `ranks`
    plus the pullers their second hops read from (which execute with them)."""
    ordered = sorted(ranks)
    if plan.fanout is None:
        return [(rank,) for rank in ordered]
    nodes: dict[int, set[int]] = {}
    for rank in ordered:
        nodes.setdefault(plan.fanout.node_of(rank), set()).update({rank, *second_hops(plan, rank)})
    return [tuple(sorted(group)) for _, group in sorted(nodes.items())]


def whole_modules(plan: Plan, entries: list[int], ranks: Collection[int]) -> list[int]:
    """`entries` plus the other destinations of their modules on the same inference ranks (among `ranks`).

    vLLM's online quantization processes a layer once all of its weights are loaded (w2_weight
    only with w13_weight), so a sampled quantized check loads and compares whole modules.
    """
    wanted = {(_module_of(plan.dests[i].name), rank) for i in entries for rank in plan.dests[i].ranks if rank in ranks}
    return [i for i, e in enumerate(plan.dests) if any((_module_of(e.name), rank) in wanted for rank in e.ranks)]


def _module_of(parameter: str) -> str:
    """`model.layers.3.mlp.experts.w2_weight` -> `model.layers.3.mlp.experts`."""
    return parameter.rsplit(".", 1)[0]


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


def vllm_load_quantized(vllm_config, base, plan: Plan, full: dict[str, torch.Tensor], chosen: set[str] | None,
                        tp_rank: int, dp_rank: int, *, pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """vLLM's own online quantization on CPU: load_weights, then process_weights_after_loading of the quantized layers.

    With `chosen` None, every trainer tensor is loaded (zeros where `full` has none) and every
    layer processed: fine for small configs, too large for full GLM-5.2. With `chosen` (parameter
    names, whole modules as whole_modules gives), only the tensors in `full` are loaded, and only
    the modules owning chosen parameters are finalized: vLLM's online loaders keep the other
    layers on meta, so a sample of a full-size model costs its own modules' bytes. The model is
    built with the kernel-choice stub (vllm_patches.triton_fp8_kernels). Attention layers' own post-load
    step (MLA absorption, not a parameter) is not run. Returns the chosen (or all) parameters.
    """
    return _vllm_load_quantized(vllm_config, base, plan, plan_conversion(vllm_config, plan), full, chosen, tp_rank, dp_rank,
                                pp_rank)


@fp8_post_load()
def _vllm_load_quantized(vllm_config, base, plan: Plan, conversion: Conversion, full: dict[str, torch.Tensor],
                         chosen: set[str] | None, tp_rank: int, dp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload import finalize_layerwise_processing

    def stream():
        for entry in plan.sources:
            tensor = full.get(entry.name)
            if tensor is None:
                if chosen is not None:  # no chosen module reads it: its layers stay unloaded, on meta
                    continue
                tensor = torch.zeros(entry.shape, dtype=getattr(torch, entry.dtype))
            yield entry.name, tensor

    with triton_fp8_kernels():
        model = build_model(vllm_config, "cpu", tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, base_config=base)
        layers = model
        if chosen is not None:
            owners = {_module_of(name) for name in chosen}
            layers = torch.nn.ModuleList([m for name, m in model.named_modules() if name in owners])
        with torch.no_grad(), parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank), platform_rounding(plan):
            model.load_weights(as_views(conversion, stream()))
            # Layers vLLM did not process while loading (padding left them incomplete) are processed here.
            finalize_layerwise_processing(layers, vllm_config.model_config)
            for module in layers.modules():
                method = getattr(module, "quant_method", None)
                if isinstance(method, QuantizeMethodBase):
                    method.process_weights_after_loading(module)
    return {name: p for name, p in model.named_parameters() if chosen is None or name in chosen}


def platform_rounding(plan: Plan) -> contextlib.AbstractContextManager:
    """Where vLLM's online quantization runs for the reference: on this CPU as a GPU engine rounds it (CudaArithmetic)
    for a plan with the CUDA scale rounding, as the CPU rounds it for the IEEE one."""
    layout = plan.header.quant_layout
    if layout is not None and layout.scale_rounding is ScaleRounding.CUDA:
        return CudaArithmetic()
    return contextlib.nullcontext()


class _ChunkViews(torch.Tensor):
    """A trainer tensor on its way through the trainer -> checkpoint conversion of verify-plan: `.contiguous()` keeps a
    view. transformers' reverse conversion makes every chunk of a stacked tensor contiguous, which copies the whole
    stack (GLM-5.2's routed experts: ~13 GB) although random_sources wrote only the bytes the sample reads."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


def as_views(conversion: Conversion, pairs):
    """`conversion(pairs)` with chunks left as views of the trainer tensors; vLLM's loaders get plain tensors (they
    narrow and copy_, whatever the strides)."""
    wrapped = ((name, t.as_subclass(_ChunkViews) if t.device.type != "meta" else t) for name, t in pairs)
    for name, tensor in conversion(wrapped):
        yield name, tensor.as_subclass(torch.Tensor) if isinstance(tensor, _ChunkViews) else tensor


def plan_conversion(vllm_config, plan: Plan) -> Conversion:
    """The plan's trainer -> checkpoint conversion (its --trainer-format) for the config vLLM was built from.

    The trainer's model is built here, outside every vLLM patch (vllm_patches.check_unpatched).
    """
    trainer = plan.header.trainer
    from .compile import trainer_tensors

    fmt = TrainerFormat.ADAPTER if trainer.adapter else TrainerFormat.parse(trainer.format)
    return Conversion(trainer_tensors(Path(vllm_config.model_config.model), trainer.dtype, trainer.adapter), fmt)


def _materialize(model: torch.nn.Module, names: set[str], fill: float) -> dict[str, torch.Tensor]:
    """Give the chosen parameters real CPU storage (filled with `fill`); the rest stay on meta.

    The Parameter objects are kept (swapped in place) so vLLM's weight_loader attributes survive.
    Where vLLM holds another reference to a parameter (Mamba layers keep a `conv_weights` view of
    `conv1d.weight`), torch refuses the swap; that parameter is replaced in every module holding it
    by a new Parameter with the same attributes, which is what load_weights (through
    named_parameters) and the digests then see.
    """
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    out = {}
    for name, buffer in persistent_buffers(model):  # buffers vLLM loads (plans write them too): new CPU tensors
        if name in names:
            owner, _, attr = name.rpartition(".")
            real = torch.full(buffer.shape, fill if buffer.dtype.is_floating_point else (0 if fill == 0 else 1), dtype=buffer.dtype)
            model.get_submodule(owner)._buffers[attr] = out[name] = real
    for name, param in model.named_parameters():
        if name in names:
            value = fill if param.dtype.is_floating_point else (0 if fill == 0 else 1)
            real = torch.full(param.shape, value, dtype=param.dtype).as_subclass(type(param))
            real.__dict__.update(param.__dict__)
            real.requires_grad_(False)
            try:
                torch.utils.swap_tensors(param, real)
            except RuntimeError:
                for module, attr in owners[id(param)]:
                    module._parameters[attr] = real
                param = real
            out[name] = param
    return out


def _vllm_load(vllm_config, base, plan: Plan, full: dict[str, torch.Tensor], chosen: set[str], tp_rank: int, dp_rank: int,
               untouched: set[str] = frozenset(), *, pp_rank: int = 0):
    """vLLM's own load_weights of the trainer's full weights into this rank's model (ground truth): the chosen
    parameters, and those of `untouched` (the plan's unloaded parameters) that the load wrote (it should write none)."""
    return _vllm_load_patched(vllm_config, base, plan_conversion(vllm_config, plan), plan, full, chosen, tp_rank, dp_rank,
                              untouched, pp_rank)


@host_independent()
def _vllm_load_patched(vllm_config, base, conversion: Conversion, plan: Plan, full: dict[str, torch.Tensor],
                       chosen: set[str], tp_rank: int, dp_rank: int, untouched: set[str], pp_rank: int):
    model = build_model(vllm_config, tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, base_config=base)
    params = _materialize(model, chosen, fill=0.0)
    sentinels = _materialize(model, set(untouched), fill=float("nan"))
    before = {name: _bytes(t).clone() for name, t in sentinels.items()}

    def stream():
        for entry in plan.sources:
            tensor = full.get(entry.name)
            if tensor is None:  # not needed by the sampled destinations: stays without data
                tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype), device="meta")
            yield entry.name, tensor

    with torch.no_grad(), parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank):
        model.load_weights(as_views(conversion, stream()))
    held = named_tensors(model, sentinels)  # a loader that replaces a parameter wrote it too
    written = {n for n, t in sentinels.items()
               if n not in held or held[n].data_ptr() != t.data_ptr() or not torch.equal(_bytes(t), before[n])}
    return params, written


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)
