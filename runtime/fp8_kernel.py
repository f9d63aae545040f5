"""Numba kernel quantizing whole 128x128 bf16 tiles to fp8 e4m3fn bytes and float32 scales, bit-exact with torch."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

BLOCK = 128
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
        # Normal fp8 range: rebias the exponent and round at mantissa bit 20, ties to even.
        odd = b.and_(b.lshr(mag, _c(20)), _c(1))
        normal = b.lshr(b.add(b.add(mag, _c(0x7FFFF - (120 << 23))), odd), _c(20))
        # Below 2**-6, as c10 does: adding 2**14 makes the float32 add round |f| to a multiple of 2**-9, ties
        # to even, and leaves the fp8 subnormal count in the low mantissa bits.
        biased = b.fadd(b.bitcast(mag, ir.FloatType()), ir.Constant(ir.FloatType(), 2.0**14))
        subnormal = b.sub(b.bitcast(biased, _I32), _c(141 << 23))
        # mag has no sign bit, so signed compares order it as unsigned ones would.
        r = b.select(b.icmp_signed("<", mag, _c(121 << 23)), subnormal, normal)
        r = b.select(b.icmp_signed(">", r, _c(0x7E)), _c(0x7E), r)
        # NaN: r is already clamped to 0x7e, and the borrow of 0x7f800000 - mag adds the 1 of 0x7f.
        nan = b.lshr(b.sub(_c(0x7F800000), mag), _c(31))
        return b.trunc(b.or_(b.or_(r, nan), sign), ir.IntType(8))
    return types.uint8(types.uint32), codegen


@njit(cache=True, nogil=True)
def f32_bits_to_e4m3fn(bits: np.ndarray, out: np.ndarray) -> None:
    """out[i] = float8_e4m3fn byte of the float32 with bits bits[i] (1-D uint32 -> 1-D uint8)."""
    for i in range(bits.size):
        out[i] = _e4m3fn_from_f32_bits(bits[i])


@njit(cache=True, nogil=True, inline="always")
def _accumulate_amax(row, top):
    """top[c] = max(top[c], |row[c]|) on bf16 bits: without the sign bit, finite bf16 order like integers."""
    for c in range(row.size):
        top[c] = max(top[c], row[c] & 0x7FFF)


@njit(cache=True, nogil=True, inline="always")
def _band_scales(top, scales, inv):
    """Per tile: scale = max(amax, 1e-4) / 448 and its reciprocal, in float32 as vLLM; returns how many tiles
    hold inf or NaN (amax bits 0x7f80 and above)."""
    nonfinite = 0
    for t in range(scales.size):
        bits = top[t * BLOCK : t * BLOCK + BLOCK].max()
        nonfinite += bits >= 0x7F80
        scale = max(_f32_from_bits(np.uint32(bits) << 16), np.float32(1e-4)) / np.float32(448.0)
        scales[t] = scale
        inv[t] = np.float32(1.0) / scale
    return nonfinite


@njit(cache=True, nogil=True, inline="always")
def _row_values(row, inv, out):
    """out = fp8 bytes of float(row) * inv[tile]."""
    for t in range(inv.size):
        scale_by = inv[t]
        for c in range(t * BLOCK, t * BLOCK + BLOCK):
            out[c] = _e4m3fn_from_f32_bits(_f32_bits(_f32_from_bits(np.uint32(row[c]) << 16) * scale_by))


@njit(cache=True, nogil=True)
def quantize_tiles(x, x_pitch, out, out_pitch, scales):
    """Quantize the whole tiles of bf16 bits x (flat, row pitch x_pitch) into fp8 bytes out (flat, row pitch
    out_pitch) and float32 scales (one per tile, its shape the tile grid); returns how many tiles hold inf or NaN.

    Band by band (BLOCK rows): the amax of the next band is gathered while this band's values are written,
    so its loads from memory overlap the conversion arithmetic.
    """
    n_brows, n_bcols = scales.shape
    width = n_bcols * BLOCK
    top, next_top = np.zeros(width, np.uint16), np.zeros(width, np.uint16)
    inv = np.zeros(n_bcols, np.float32)
    for r in range(BLOCK):
        _accumulate_amax(x[r * x_pitch : r * x_pitch + width], top)
    nonfinite = 0
    for bi in range(n_brows):
        nonfinite += _band_scales(top, scales[bi], inv)
        ahead = bi + 1 < n_brows
        next_top[:] = 0
        for r in range(bi * BLOCK, bi * BLOCK + BLOCK):
            _row_values(x[r * x_pitch : r * x_pitch + width], inv, out[r * out_pitch : r * out_pitch + width])
            if ahead:
                nr = r + BLOCK
                _accumulate_amax(x[nr * x_pitch : nr * x_pitch + width], next_top)
        top, next_top = next_top, top
    return nonfinite
