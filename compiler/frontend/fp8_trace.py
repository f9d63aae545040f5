"""Trace vLLM's online fp8_per_block post-load step on meta: which bf16 tensors become which fp8 weights and scales."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from weightplan.runtime.fp8.numerics import BLOCK, block_grid
from weightplan.runtime.plan.schema import DerivedItem, dtype_name
from .errors import ModelConfigError
from .vllm_patches import fp8_post_load

QUANT_METHODS = ("Fp8PerBlockOnlineLinearMethod", "Fp8PerBlockOnlineMoEMethod")
# bf16 parameter vLLM's loaders write -> (fp8 weight, float32 block scale) after process_weights_after_loading
_FINAL_NAMES = {"weight": ("weight", "weight_scale_inv"), "w13_weight": ("w13_weight", "w13_weight_scale_inv"),
                "w2_weight": ("w2_weight", "w2_weight_scale_inv")}


@dataclass(frozen=True)
class QuantTensor:
    """One bf16 tensor vLLM quantizes after loading: `staging` (bf16, what load_weights writes) -> weight + scale."""

    staging: str
    weight: str
    scale: str
    shape: tuple[int, ...]
    scale_shape: tuple[int, ...]
    padding: tuple[tuple[int, int], ...] = ()  # [start, end) element ranges the post-load step sets to zero


def quantized_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    for name, module in model.named_modules():
        if type(getattr(module, "quant_method", None)).__name__ in QUANT_METHODS:
            yield name, module


def unwrap_online_loaders(model: torch.nn.Module) -> None:
    """Give the quantized layers back their own weight loaders, so load_weights writes the bf16 parameters.

    Online quantization wraps them to buffer loads and quantize each layer once complete
    (`online_process_loader`); the trace records the loads, and the post-load step is traced apart.
    """
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader

    for _, module in quantized_modules(model):
        for param in module.parameters(recurse=False):
            if hasattr(param, "weight_loader"):
                param.weight_loader = _get_original_loader(param)


@fp8_post_load()
def trace_post_load(model: torch.nn.Module, wanted: Callable[[str], bool] | None = None) -> list[QuantTensor]:
    """Run each quantized layer's process_weights_after_loading on meta (those whose name `wanted` accepts, if given);
    return the quantized tensors, in model order.

    The final parameters (names, shapes, dtypes, strides) are read back from vLLM, and each must be the
    plain 128x128 block layout (fp8 weight shaped like the bf16 tensor, float32 scale per block, both
    contiguous); anything else (a kernel's shuffle, swizzled or transposed scales) is refused, naming the layer.
    """
    found: list[QuantTensor] = []
    loaded = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
    # per_block_cast_to_fp8 is torch.compile'd; on meta only shapes and dtypes come out, which eager
    # gives alike, while compiling it costs ~12 s once per process and a guard check per call.
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        for prefix, module in quantized_modules(model):
            if wanted is not None and not wanted(prefix):
                continue
            padding = _traced_padding(module, prefix)
            final = dict(module.named_parameters(recurse=False))
            for local, (wname, sname) in _FINAL_NAMES.items():
                key = f"{prefix}.{local}"
                if key not in loaded:
                    continue
                shape, dtype = loaded[key]
                weight, scale = final.get(wname), final.get(sname)
                expected_scale = _scale_shape(shape)
                if (weight is None or scale is None or tuple(weight.shape) != shape or weight.dtype != torch.float8_e4m3fn
                        or tuple(scale.shape) != expected_scale or scale.dtype != torch.float32
                        or not weight.is_contiguous() or not scale.is_contiguous()):
                    got = {n: (tuple(p.shape), dtype_name(p.dtype), "contiguous" if p.is_contiguous() else
                               f"strides {tuple(p.stride())}") for n, p in final.items()}
                    raise ModelConfigError(
                        f"fp8_per_block: {prefix} ({type(module.quant_method).__name__}) did not produce the plain block "
                        f"layout for {local} {list(shape)} {dtype_name(dtype)}: got {got}; this compiler supports only "
                        f"{BLOCK}x{BLOCK} fp8 e4m3 weights with float32 scales and no kernel shuffle"
                    )
                found.append(QuantTensor(key, f"{prefix}.{wname}", f"{prefix}.{sname}", shape, expected_scale,
                                         padding.get(key, ())))
    return found


def _traced_padding(module: torch.nn.Module, prefix: str) -> dict[str, tuple[tuple[int, int], ...]]:
    """Run the module's process_weights_after_loading, recording the constants it writes into its bf16 parameters
    (vLLM's `_zero_padding` of MoE rows/cols added to reach 128 multiples); each must be zero."""
    from .lazy_weight import WriteRecorder, tracing

    tracer = WriteRecorder({f"{prefix}.{name}": p for name, p in module.named_parameters(recurse=False)}, only_fills=True)
    tracer.loading = f"{prefix} (process_weights_after_loading)"
    with tracing(tracer):
        module.quant_method.process_weights_after_loading(module)
    out: dict[str, list] = {}
    for a in tracer.assignments:
        if a.node.args[0] != 0:
            raise ModelConfigError(f"fp8_per_block: {prefix}'s post-load step writes the constant {a.node.args[0]} into "
                                   f"{a.dest}; only zero padding is supported")
        starts, ends = a.geometry.intervals()
        out.setdefault(a.dest, []).extend(zip(starts.tolist(), ends.tolist()))
    return {name: _union(ranges) for name, ranges in out.items()}


def _union(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint [start, end) ranges covering `ranges` (row and column padding meet at the corner)."""
    merged: list[list[int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return tuple((start, end) for start, end in merged)


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    matrices, rows, cols = block_grid(shape)
    return (*shape[:-2], rows, cols)


def derived_state(model: torch.nn.Module, wanted: Callable[[str], bool] | None = None) -> list[DerivedItem]:
    """Post-load state vLLM derives from loaded parameters: MLA layers absorb kv_b_proj into W_UK/W_UV when processed.

    With or without quantization (bf16 MLA absorbs too). With fp8, read after trace_post_load
    (kv_b_proj's parameters are then the processed ones); `wanted` as there.
    """
    from .vllm_compat import is_deferred_attention_layer

    names = {id(module): name for name, module in model.named_modules()}
    out = []
    for name, module in model.named_modules():
        kv_b = getattr(module, "kv_b_proj", None)
        # Only MLA layers derive state from loaded weights; other attention layers' post-load step reads none.
        if is_deferred_attention_layer(module) and kv_b is not None and (wanted is None or wanted(name)):
            reads = tuple(f"{names[id(kv_b)]}.{n}" for n, _ in kv_b.named_parameters(recurse=False)) if id(kv_b) in names else ()
            out.append(DerivedItem(name, "attention process_weights_after_loading (MLA: W_UK/W_UV absorbed from kv_b_proj)",
                               reads, DerivedItem.RECEIVER))
    return out
