"""The Triton fp8 quantizer on a GPU: its bytes under both roundings against independent paths, and its GB/s of bf16 input.

`measure_triton_quantizer(device)` is what `bench_quantizer.py --device cuda` prints and what gpu_check.py can call.
On a 4096 x 7168 bf16 tensor it checks the kernel's bytes under the CUDA rule against the runtime's torch path on
the GPU (PyTorch's own reciprocal multiply) and under the IEEE rule against the numba host kernel on a copy in host
memory, then times the kernel (each num_warps tried), the torch path and a device-to-device copy of the input.
"""

from __future__ import annotations

import importlib.util
import statistics

import torch

SHAPE = (4096, 7168)
TARGET_GBYTES_PER_S = 1000.0
NUM_WARPS = (4, 8, 16)


def _seconds(fn, repeats: int) -> float:
    """Median seconds of fn() over CUDA events, after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def measure_triton_quantizer(device: str = "cuda", repeats: int = 20) -> dict:
    """{"status": "ok" | "failed" | "skipped", "reason", "quantizer_gbytes_per_s", ...} for the Triton kernel on
    `device` (a CUDA device); "skipped" where there is no CUDA device or no Triton. "failed" if a byte check fails
    or the best rate is below TARGET_GBYTES_PER_S."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return {"status": "skipped", "reason": f"no CUDA device ({device!r} asked, cuda available: "
                                               f"{torch.cuda.is_available()})"}
    if importlib.util.find_spec("triton") is None:
        return {"status": "skipped", "reason": "triton is not importable"}
    from weightplan.runtime.fp8.numerics import BlockQuantizer
    from weightplan.runtime.fp8.rounding import ScaleRounding
    from weightplan.runtime.fp8.triton_quant import quantize_tiles_triton

    h, w = SHAPE
    x = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    gx = x.to(device)
    values = torch.empty(SHAPE, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(h // 128, w // 128, device=device)
    out = {}
    for rounding in ScaleRounding:
        quantize_tiles_triton(gx, values, scales, h, w, rounding)
        torch.cuda.synchronize()
        out[rounding] = (values.cpu().clone(), scales.cpu().clone())  # .cpu() of a host tensor is no copy
    torch_values, torch_scales = torch.empty_like(values), torch.empty_like(scales)
    BlockQuantizer(ScaleRounding.CUDA, use_kernel=False)(gx, torch_values, torch_scales)
    host = {}
    for rounding in ScaleRounding:
        host[rounding] = torch.empty(SHAPE, dtype=torch.float8_e4m3fn), torch.empty(h // 128, w // 128)
        BlockQuantizer(rounding)(x, *host[rounding])
    checks = {
        "cuda_rule_equals_torch_path_on_gpu": _same(out[ScaleRounding.CUDA][0], torch_values.cpu())
        and _same(out[ScaleRounding.CUDA][1], torch_scales.cpu()),
        **{f"{r.value}_rule_equals_host_kernel": _same(out[r][0], host[r][0]) and _same(out[r][1], host[r][1])
           for r in ScaleRounding},
        "rules_differ": not _same(out[ScaleRounding.CUDA][1], out[ScaleRounding.IEEE][1]),
    }
    gbytes = gx.numel() * gx.element_size() / 1e9
    by_warps = {}
    for warps in NUM_WARPS:
        t = _seconds(lambda: quantize_tiles_triton(gx, values, scales, h, w, ScaleRounding.CUDA, num_warps=warps), repeats)
        by_warps[warps] = round(gbytes / t, 1)
    best = max(by_warps, key=by_warps.get)
    ieee = round(gbytes / _seconds(lambda: quantize_tiles_triton(gx, values, scales, h, w, ScaleRounding.IEEE,
                                                                 num_warps=best), repeats), 1)
    copy = torch.empty_like(gx)
    figures = {
        "shape": list(SHAPE),
        "quantizer_gbytes_per_s": min(by_warps[best], ieee),
        "cuda_rule_gbytes_per_s_by_num_warps": by_warps,
        "ieee_rule_gbytes_per_s": ieee,
        "best_num_warps": best,
        "torch_path_gbytes_per_s": round(gbytes / _seconds(lambda: torch_path(gx, torch_values, torch_scales), repeats), 1),
        "copy_gbytes_per_s": round(gbytes / _seconds(lambda: copy.copy_(gx), repeats), 1),  # bytes copied
        "device_name": torch.cuda.get_device_name(device),
        **checks,
    }
    wrong = [name for name, good in checks.items() if not good]
    if wrong:
        return {"status": "failed", "reason": f"byte checks failed: {', '.join(wrong)}", **figures}
    if figures["quantizer_gbytes_per_s"] < TARGET_GBYTES_PER_S:
        return {"status": "failed", "reason": f"{figures['quantizer_gbytes_per_s']} GB/s of bf16 input, below the "
                                              f"target {TARGET_GBYTES_PER_S:.0f}", **figures}
    return {"status": "ok", "reason": "bytes equal under both rules; GB/s of bf16 input read", **figures}
