"""Numba kernel quantizing whole 128x128 bf16 tiles to fp8 e4m3fn bytes and float32 scales, bit-exact with torch."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .format import BLOCK
from .rounding import RECIPROCAL

_I32 = ir.IntType(32)


def _c(value: int) -> ir.Constant:
    return ir.Constant(_I32, value & 0xFFFFFFFF)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret uint32 bits as float32."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """Reinterpret float32 as uint32 bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(types.float32), codegen


def _round_e4m3fn(b, mag):
    """Emit the e4m3fn magnitude byte (as i32) of float32 bits mag (sign bit clear), not clamped: above 464
    it runs past 0x7e."""
    # Normal fp8 range: rebias the exponent and round at mantissa bit 20, ties to even.
    odd = b.and_(b.lshr(mag, _c(20)), _c(1))
    normal = b.lshr(b.add(b.add(mag, _c(0x7FFFF - (120 << 23))), odd), _c(20))
    # Below 2**-6, as c10 does: adding 2**14 makes the float32 add round |f| to a multiple of 2**-9, ties
    # to even, and leaves the fp8 subnormal count in the low mantissa bits.
    f = b.bitcast(mag, ir.FloatType())
    subnormal = b.sub(b.bitcast(b.fadd(f, ir.Constant(ir.FloatType(), 2.0**14)), _I32), _c(141 << 23))
    # A float compare: an integer one on known non-negative values becomes an unsigned one, which AVX2 lacks.
    return b.select(b.fcmp_ordered("<", f, ir.Constant(ir.FloatType(), 2.0**-6)), subnormal, normal)


@intrinsic
def _e4m3fn_from_f32_bits(typingctx, bits):
    """float32 bits -> float8_e4m3fn byte, step for step c10's fp8e4m3fn_from_fp32_value (torch 2.13).

    Round to nearest even; NaN -> 0x7f; inf and anything rounding above 448 saturate to 0x7e; the sign is
    kept (-0 -> 0x80). Emitted as 32-bit LLVM ops because numba widens uint32 arithmetic to 64 bits, which
    halves the vector lanes.
    """
    def codegen(context, builder, sig, args):
        b = builder
        (u,) = args
        mag = b.and_(u, _c(0x7FFFFFFF))
        sign = b.and_(b.lshr(u, _c(24)), _c(0x80))
        r = _round_e4m3fn(b, mag)
        r = b.select(b.icmp_signed(">", r, _c(0x7E)), _c(0x7E), r)
        # NaN: r is already clamped to 0x7e, and the borrow of 0x7f800000 - mag adds the 1 of 0x7f.
        nan = b.lshr(b.sub(_c(0x7F800000), mag), _c(31))
        return b.trunc(b.or_(b.or_(r, nan), sign), ir.IntType(8))
    return types.uint8(types.uint32), codegen


@intrinsic
def _e4m3fn_from_scaled_bf16(typingctx, half, scale_by):
    """e4m3fn byte of float32(bf16 bits half) * scale_by (> 0) where the product is finite and below 464 in
    magnitude, as in every finite tile (see quantize_tiles): there it is _e4m3fn_from_f32_bits of the product,
    whose clamp and NaN steps do nothing. |half| is scaled and half's sign put on the byte, in 16-bit lanes.
    """
    def codegen(context, builder, sig, args):
        b = builder
        h, scale_by = args
        i16 = ir.IntType(16)
        wide = b.shl(b.zext(b.and_(h, ir.Constant(i16, 0x7FFF)), _I32), _c(16))
        mag = b.bitcast(b.fmul(b.bitcast(wide, ir.FloatType()), scale_by), _I32)
        sign = b.and_(b.lshr(h, ir.Constant(i16, 8)), ir.Constant(i16, 0x80))
        return b.or_(b.trunc(_round_e4m3fn(b, mag), ir.IntType(8)), b.trunc(sign, ir.IntType(8)))
    return types.uint8(types.uint16, types.float32), codegen


@njit(cache=True, nogil=True)
def f32_bits_to_e4m3fn(bits: np.ndarray, out: np.ndarray) -> None:
    """out[i] = float8_e4m3fn byte of the float32 with bits bits[i] (1-D uint32 -> 1-D uint8)."""
    for i in range(bits.size):
        out[i] = _e4m3fn_from_f32_bits(bits[i])


@njit(cache=True, nogil=True)
def scaled_bf16_to_e4m3fn(halves: np.ndarray, scale_by: np.float32, out: np.ndarray) -> None:
    """out[i] = _e4m3fn_from_scaled_bf16(halves[i], scale_by) (1-D uint16 -> 1-D uint8), for tests."""
    for i in range(halves.size):
        out[i] = _e4m3fn_from_scaled_bf16(halves[i], scale_by)


@njit(cache=True, nogil=True, inline="always")
def _accumulate_amax(row, top):
    """top[c] = max(top[c], |row[c]|) on bf16 bits: without the sign bit, finite bf16 order like integers."""
    for c in range(row.size):
        top[c] = max(top[c], row[c] & 0x7FFF)


@njit(cache=True, nogil=True, inline="always")
def _band_scales(top, scales, inv, cuda_rounding):
    """Per tile: scale = max(amax, 1e-4) / 448 as the plan's rounding says (times fl32(1/448) under CUDA's, divided
    under IEEE's; runtime/fp8/rounding.py) and its reciprocal, in float32 as vLLM; returns how many tiles hold inf or NaN
    (amax bits 0x7f80 and above)."""
    nonfinite = 0
    for t in range(scales.size):
        bits = top[t * BLOCK : t * BLOCK + BLOCK].max()
        nonfinite += bits >= 0x7F80
        amax = max(_f32_from_bits(np.uint32(bits) << 16), np.float32(1e-4))
        scale = amax * np.float32(RECIPROCAL) if cuda_rounding else amax / np.float32(448.0)
        scales[t] = scale
        inv[t] = np.float32(1.0) / scale
    return nonfinite


@njit(cache=True, nogil=True)
def _row_values(row, inv, out, finite, ahead, top):
    """out = fp8 bytes of float(row) * inv[tile] (the general cast, or the in-range one if the band is finite), and
    top = max(top, |ahead|) as _accumulate_amax unless ahead is empty: in the same loop as the finite cast, so
    ahead's loads from memory overlap its arithmetic (in separate passes they did not)."""
    for t in range(inv.size):
        scale_by = inv[t]
        # Per-tile slices index from 0, so numba's negative-index wraparound folds away.
        lo, hi = t * BLOCK, t * BLOCK + BLOCK
        src, dst = row[lo:hi], out[lo:hi]
        if not finite:
            for c in range(BLOCK):
                dst[c] = _e4m3fn_from_f32_bits(_f32_bits(_f32_from_bits(np.uint32(src[c]) << 16) * scale_by))
        elif ahead.size:
            nxt, tp = ahead[lo:hi], top[lo:hi]
            for c in range(BLOCK):
                dst[c] = _e4m3fn_from_scaled_bf16(src[c], scale_by)
                tp[c] = max(tp[c], nxt[c] & 0x7FFF)
        else:
            for c in range(BLOCK):
                dst[c] = _e4m3fn_from_scaled_bf16(src[c], scale_by)
    if not finite and ahead.size:
        _accumulate_amax(ahead, top)


@njit(cache=True, nogil=True)
def quantize_tiles(x, x_pitch, out, out_pitch, scales, cuda_rounding):
    """Quantize the whole tiles of bf16 bits x (flat, row pitch x_pitch) into fp8 bytes out (flat, row pitch
    out_pitch) and float32 scales (one per tile, its shape the tile grid), the scales rounded as CUDA rounds them if
    `cuda_rounding`, else by IEEE division; returns how many tiles hold inf or NaN.

    Band by band (BLOCK rows): the amax of the next band is gathered while this band's values are written.
    In a finite tile, |x| <= amax keeps |x * inv| within one float32 ulp of 448 (tests check every bf16 amax),
    far below 464 where fp8 rounding saturates, so _e4m3fn_from_scaled_bf16 applies; a band holding inf or NaN
    goes through the general cast (its tiles are redone by the caller anyway).
    """
    n_brows, n_bcols = scales.shape
    width = n_bcols * BLOCK
    top, next_top = np.zeros(width, np.uint16), np.zeros(width, np.uint16)
    inv = np.zeros(n_bcols, np.float32)
    for r in range(BLOCK):
        _accumulate_amax(x[r * x_pitch : r * x_pitch + width], top)
    nonfinite = 0
    for bi in range(n_brows):
        band_nonfinite = _band_scales(top, scales[bi], inv, cuda_rounding)
        nonfinite += band_nonfinite
        ahead = bi + 1 < n_brows
        next_top[:] = 0
        for r in range(bi * BLOCK, bi * BLOCK + BLOCK):
            nr = r + BLOCK
            next_row = x[nr * x_pitch : nr * x_pitch + width] if ahead else x[:0]
            _row_values(x[r * x_pitch : r * x_pitch + width], inv, out[r * out_pitch : r * out_pitch + width],
                        band_nonfinite == 0, next_row, next_top)
        top, next_top = next_top, top
    return nonfinite
