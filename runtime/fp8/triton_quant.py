"""Triton kernel quantizing whole 128x128 bf16 tiles to fp8 e4m3fn bytes and float32 scales, one program per tile."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import WeightplanError
from .format import BLOCK, FP8, FP8_MAX
from .rounding import NAN_SCALE_BITS, NAN_VALUE_BYTE, RECIPROCAL, ScaleRounding

# Globals a Triton kernel reads must be constexpr.
NAN_BYTE: tl.constexpr = tl.constexpr(NAN_VALUE_BYTE)
NAN_SCALE: tl.constexpr = tl.constexpr(NAN_SCALE_BITS)
FLOOR_BITS: tl.constexpr = tl.constexpr(int(torch.tensor(1e-4, dtype=torch.float32).view(torch.int32)))  # fl32(1e-4)


@triton.jit
def _e4m3fn_byte(p):
    """The e4m3fn byte (in an int32) of float32 p, as c10 rounds it (nearest even, saturating at 0x7e), every NaN
    as 0x7f: kernel.py's _e4m3fn_from_f32_bits in integer steps. Triton's own `.to(tl.float8e4nv)` is not used:
    the interpreter's conversion does not round as c10 does, and this must give the same bytes interpreted and
    compiled."""
    u = p.to(tl.int32, bitcast=True)
    mag = u & 0x7FFFFFFF
    # At and above 2**-6: rebias the exponent (127 -> 7) and round at mantissa bit 20, ties to even.
    normal = (mag + (0x7FFFF - (120 << 23)) + ((mag >> 20) & 1)) >> 20
    # Below: the float32 add of 2**14 rounds |p| to a multiple of 2**-9 (ties to even) and leaves the subnormal
    # count in the low bits. Launched with fp fusion off, so p's multiply is never fused into this add.
    subnormal = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    r = tl.minimum(tl.where(mag < 0x3C800000, subnormal, normal), 0x7E)
    return tl.where(mag > 0x7F800000, NAN_BYTE, r | ((u >> 24) & 0x80))


@triton.jit
def _quantize_tile_kernel(x_ptr, x_pitch, v_ptr, v_pitch, s_ptr, s_pitch_row, s_pitch_col,
                          CUDA_RULE: tl.constexpr, RECIP: tl.constexpr, FMAX: tl.constexpr, TILE: tl.constexpr):
    """Tile (program 0, program 1) of bf16 bits x into e4m3fn bytes v and the float32 bits of its scale."""
    tile_row, tile_col = tl.program_id(0), tl.program_id(1)
    rows = (tile_row * TILE + tl.arange(0, TILE)).to(tl.int64)[:, None]
    cols = (tile_col * TILE + tl.arange(0, TILE))[None, :]
    half = tl.load(x_ptr + rows * x_pitch + cols).to(tl.int32)
    # amax over bits without the sign: finite bf16 magnitudes order like integers and NaN bits top inf's, so a NaN
    # tile gets a NaN scale as torch's amax gives, whatever max's NaN semantics on the device.
    amax_bits = tl.maximum(tl.max(tl.max(half & 0x7FFF, axis=1), axis=0) << 16, FLOOR_BITS)
    amax = amax_bits.to(tl.float32, bitcast=True)
    if CUDA_RULE:
        scale = amax * tl.full((), RECIP, tl.float32)
    else:
        scale = tl.math.div_rn(amax, tl.full((), FMAX, tl.float32))
    inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), scale)
    values = _e4m3fn_byte((half << 16).to(tl.float32, bitcast=True) * inv)
    tl.store(v_ptr + rows * v_pitch + cols, values.to(tl.uint8))
    scale_bits = tl.where(amax_bits > 0x7F800000, NAN_SCALE, scale.to(tl.int32, bitcast=True))
    tl.store(s_ptr + tile_row * s_pitch_row + tile_col * s_pitch_col, scale_bits)


@triton.jit
def _e4m3fn_kernel(p_ptr, out_ptr, n, SIZE: tl.constexpr):
    """out[i] = _e4m3fn_byte(p[i]) for float32 p: the rounding alone, for tests."""
    offs = tl.program_id(0) * SIZE + tl.arange(0, SIZE)
    mask = offs < n
    tl.store(out_ptr + offs, _e4m3fn_byte(tl.load(p_ptr + offs, mask=mask)).to(tl.uint8), mask=mask)


def e4m3fn_bytes_triton(p: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bytes of a 1-D contiguous float32 tensor through the kernel's rounding (NaN -> 0x7f)."""
    out = torch.empty(p.numel(), dtype=torch.uint8, device=p.device)
    size = 1 << 14
    _e4m3fn_kernel[(triton.cdiv(p.numel(), size),)](p, out, p.numel(), SIZE=size, enable_fp_fusion=False)
    return out


def _check(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int) -> None:
    """One-line WeightplanError unless the views are what the kernel reads and writes."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or values.dtype != FP8 or scales.dtype != torch.float32:
        raise WeightplanError(f"triton fp8 quantizer: wants a 2-D bf16 input, fp8 e4m3fn values and float32 scales, "
                              f"got {x.dtype} {tuple(x.shape)}, {values.dtype}, {scales.dtype}")
    if hf % BLOCK or wf % BLOCK or hf > min(x.shape[0], values.shape[0]) or wf > min(x.shape[1], values.shape[1]) \
            or hf // BLOCK > scales.shape[0] or wf // BLOCK > scales.shape[1]:
        raise WeightplanError(f"triton fp8 quantizer: whole tiles {hf}x{wf} do not fit input {tuple(x.shape)}, "
                              f"values {tuple(values.shape)} and scales {tuple(scales.shape)}")
    if (x.stride(1) != 1 and wf > 1) or (values.stride(1) != 1 and wf > 1):
        raise WeightplanError(f"triton fp8 quantizer: input and values need unit column stride, got "
                              f"{x.stride()} and {values.stride()}")
    if len({x.device, values.device, scales.device}) != 1:
        raise WeightplanError(f"triton fp8 quantizer: input, values and scales on several devices "
                              f"({x.device}, {values.device}, {scales.device})")
    if x.device.type != "cuda" and not interpreted():
        raise WeightplanError(f"triton fp8 quantizer: tensors on {x.device} need a CUDA device, or TRITON_INTERPRET=1 "
                              "set before this module was imported")


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when they were defined)."""
    return not isinstance(_quantize_tile_kernel, triton.runtime.JITFunction)


def quantize_tiles_triton(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, hf: int, wf: int,
                          rounding: ScaleRounding, num_warps: int = 8) -> None:
    """Tiles x[:hf, :wf] (hf, wf multiples of 128) into values[:hf, :wf] and scales[:hf/128, :wf/128], as TorchTiles
    does, under `rounding` and with canonical NaN bytes (runtime/fp8/rounding.py), in one launch.

    x: bf16, values: fp8 e4m3fn, both 2-D with unit column stride and any row stride; scales: float32, any strides.
    One read of x, one write of values. Runs on a CUDA device, or on host tensors under TRITON_INTERPRET=1.
    """
    _check(x, values, scales, hf, wf)
    if not hf or not wf:
        return
    _quantize_tile_kernel[(hf // BLOCK, wf // BLOCK)](
        x.view(torch.int16), x.stride(0), values.view(torch.uint8), values.stride(0),
        scales.view(torch.int32), scales.stride(0), scales.stride(1),
        CUDA_RULE=ScaleRounding(rounding) is ScaleRounding.CUDA, RECIP=RECIPROCAL, FMAX=FP8_MAX, TILE=BLOCK,
        num_warps=num_warps, enable_fp_fusion=False)
