"""Checks of runtime/fp8/triton_quant.py run by Triton's interpreter in a process of their own (see test_fp8_triton.py).

Usage: python -m tests.runtime.fp8_triton_interpreted CHECK (from the repository root). TRITON_INTERPRET must be
set before Triton reads it, which a pytest process that already imported triton cannot promise.
"""

from __future__ import annotations

import os
import sys

if "triton" in sys.modules:
    raise SystemExit("run this module in a fresh process: triton is already imported")
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from weightplan.runtime.fp8.format import BLOCK, FP8  # noqa: E402
from weightplan.runtime.fp8.numerics import BlockQuantizer  # noqa: E402
from weightplan.runtime.fp8.rounding import ScaleRounding, block_scale, canonical_nans_  # noqa: E402
from weightplan.runtime.fp8.triton_quant import e4m3fn_bytes_triton, quantize_tiles_triton  # noqa: E402

from ..support.fp8 import same_bytes  # noqa: E402

BF16_MAX_BITS = 0x7F7F
KINDS = ("normal", "zero", "subnormal", "max", "inf", "nan", "nan_inf", "neg_zero")


def reference(x: torch.Tensor, rounding: ScaleRounding) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of runtime/fp8/rounding.py in plain torch ops on the host, for whole tiles of x: (values, scales)."""
    h, w = x.shape
    tiles = x.float().view(h // BLOCK, BLOCK, w // BLOCK, BLOCK)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)  # NaN propagates through both, as on a GPU
    scale = block_scale(amax, rounding)
    inv = torch.div(torch.ones_like(scale), scale)
    values = torch.mul(tiles, inv).to(FP8).view(h, w)
    scale = scale.view(h // BLOCK, w // BLOCK).contiguous()
    canonical_nans_(values, scale)
    return values, scale


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


def _tile(kind: str, magnitude: float, g: torch.Generator) -> torch.Tensor:
    """One 128x128 bf16 tile of `kind` (KINDS); normal tiles are gaussian times `magnitude`, kept finite."""
    base = torch.randn(BLOCK, BLOCK, generator=g, dtype=torch.float64)
    spots = torch.randint(0, BLOCK * BLOCK, (5,), generator=g)
    if kind == "zero":
        return torch.zeros(BLOCK, BLOCK, dtype=torch.bfloat16)
    if kind == "neg_zero":
        return _bf16(torch.full((BLOCK, BLOCK), -0x8000))
    if kind == "subnormal":  # every value a bf16 subnormal or zero, both signs
        bits = torch.randint(0, 0x80, (BLOCK, BLOCK), generator=g) | (torch.randint(0, 2, (BLOCK, BLOCK), generator=g) << 15)
        return _bf16(bits - (bits >> 15 << 16))
    tile = (base * magnitude).clamp(-3.3e38, 3.3e38).to(torch.bfloat16).view(-1)
    if kind == "max":
        tile[spots[:2]] = _bf16(torch.tensor([BF16_MAX_BITS, (BF16_MAX_BITS | 0x8000) - 0x10000]))
    if kind in ("inf", "nan_inf"):
        tile[spots[:2]] = torch.tensor([float("inf"), float("-inf")], dtype=torch.bfloat16)
    if kind in ("nan", "nan_inf"):  # NaNs of either sign and of other payloads than the default
        tile[spots[2:]] = _bf16(torch.tensor([0x7FC0, 0x7F81, 0xFFC1 - 0x10000]))
    return tile.view(BLOCK, BLOCK)


def _strided(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """x copied into columns [left, left + width) of a wider buffer: a view with row pitch > width."""
    wide = torch.zeros(x.shape[0], left + x.shape[1] + right, dtype=x.dtype)
    wide[:, left : left + x.shape[1]] = x
    return wide[:, left : left + x.shape[1]]


def _kernel(x: torch.Tensor, rounding: ScaleRounding, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on x into strided values (row pitch width + pad) and scales (a column slice of a wider
    buffer, so neither stride is the contiguous one)."""
    h, w = x.shape
    values = _strided(torch.zeros(h, w, dtype=FP8), pad, 1)
    scales = torch.zeros(h // BLOCK, w // BLOCK + 2)[:, 1:-1]
    quantize_tiles_triton(x, values, scales, h, w, rounding)
    return values, scales


def check_rounding() -> None:
    """The kernel's float32 -> e4m3fn rounding against torch (c10) on every float32 whose low 12 mantissa bits are one
    of 0, 1, 0x7ff, 0x800, 0x801, 0xfff, whatever the other 20 bits: every exponent, sign, tie (exact halfway cuts
    fall at bits 20..24, above the varied 12), just-off tie, zero, subnormal, inf and NaN; NaN must give 0x7f."""
    high = np.arange(1 << 20, dtype=np.uint32) << 12
    for low in (0, 1, 0x7FF, 0x800, 0x801, 0xFFF):
        p = torch.from_numpy((high | np.uint32(low)).view(np.float32))
        ref = p.to(FP8).view(torch.uint8).masked_fill(p.isnan(), 0x7F)
        got = e4m3fn_bytes_triton(p)
        bad = torch.nonzero(got != ref).flatten()
        assert bad.numel() == 0, (f"float32 bits {int(p[bad[0]:bad[0] + 1].view(torch.int32)) & 0xFFFFFFFF:#010x}: "
                                  f"kernel {int(got[bad[0]]):#04x}, torch {int(ref[bad[0]]):#04x} ({bad.numel()} differ)")


@settings(max_examples=40, deadline=None, derandomize=os.environ.get("HYPOTHESIS_PROFILE", "ci") != "explore",
          print_blob=True)
@given(
    tile_rows=st.integers(1, 3),
    tile_cols=st.integers(1, 3),
    left=st.integers(0, 40),
    right=st.integers(1, 200),
    value_pad=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def check_property(tile_rows, tile_cols, left, right, value_pad, seed, data):
    """Any grid of tiles of any kind and magnitude (1e-30 .. bf16 max), in strided views: the kernel writes the
    reference's bytes under both roundings, and under IEEE the numba host kernel's where every tile is finite."""
    g = torch.Generator().manual_seed(seed)
    n = tile_rows * tile_cols
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
    magnitudes = data.draw(st.lists(st.sampled_from([1e-30, 1e-20, 3e-5, 1e-4, 0.02, 1.0, 448.0, 6e4, 1e20, 3e38]) |
                                    st.floats(1e-30, 3e38), min_size=n, max_size=n))
    x = torch.cat([torch.cat([_tile(kinds[r * tile_cols + c], magnitudes[r * tile_cols + c], g)
                              for c in range(tile_cols)], dim=1) for r in range(tile_rows)])
    x = _strided(x, left, right)
    for rounding in ScaleRounding:
        values, scales = _kernel(x, rounding, value_pad)
        ref_values, ref_scales = reference(x, rounding)
        assert same_bytes(values, ref_values), (rounding, kinds)
        assert same_bytes(scales, ref_scales), (rounding, kinds)
        host_values = torch.empty(x.shape, dtype=FP8)  # the numba kernel, torch ops for tiles holding inf or NaN
        host_scales = torch.empty(tile_rows, tile_cols)
        BlockQuantizer(rounding)(x, host_values, host_scales)
        assert same_bytes(values, host_values) and same_bytes(scales, host_scales), (rounding, kinds)


def check_rules_differ() -> None:
    """On gaussian data the two roundings give other scales in some tiles (so a kernel ignoring the rule fails), and
    the kernel gives each rule's reference bytes."""
    x = (torch.randn(1024, 384, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    out = {}
    for rounding in ScaleRounding:
        out[rounding] = _kernel(x, rounding, 0)
        ref_values, ref_scales = reference(x, rounding)
        assert same_bytes(out[rounding][0], ref_values) and same_bytes(out[rounding][1], ref_scales)
    differ = int((out[ScaleRounding.CUDA][1] != out[ScaleRounding.IEEE][1]).sum())
    assert 0 < differ < 24, differ
    assert not same_bytes(out[ScaleRounding.CUDA][0], out[ScaleRounding.IEEE][0])


CHECKS = {"rounding": check_rounding, "property": check_property, "rules_differ": check_rules_differ}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok")
