"""Every fp8 quantizing path writes the plan's scale rounding bit for bit, special values included (runtime/fp8/rounding.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime.fp8.numerics import BlockQuantizer, per_block_fp8, quantize_on_device
from weightplan.runtime.fp8.rounding import NAN_SCALE_BITS, RECIPROCAL, ScaleRounding, block_scale, rounding_of

from ..support.fp8 import ROUNDINGS, same_bytes, vllm_per_block

BF16_MAX = torch.finfo(torch.bfloat16).max
# What a tile may hold besides scaled normal values: each fills a whole tile, or one element of it.
SPECIALS = {
    "zero": 0.0, "minus_zero": -0.0, "bf16_max": BF16_MAX, "minus_bf16_max": -BF16_MAX,
    "inf": float("inf"), "minus_inf": -float("inf"), "nan": float("nan"), "minus_nan": -float("nan"),
    "subnormal": 2.0**-133, "below_floor": 3e-5,
}


def _tensor(rows, cols, log_scale, specials, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0**log_scale
    for name, tile, whole in specials:
        r0, c0 = (tile % max(1, -(-rows // 128))) * 128, (tile // 7 % max(1, -(-cols // 128))) * 128
        if whole:
            x[r0 : r0 + 128, c0 : c0 + 128] = SPECIALS[name]
        else:
            x[min(r0 + tile % 128, rows - 1), min(c0 + tile % 97, cols - 1)] = SPECIALS[name]
    return x.to(torch.bfloat16)


def _paths(x: torch.Tensor, rounding: ScaleRounding, pitch: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each path's (values, scales) of x: numba kernel and torch ops on a strided view, the reference, the device path."""
    rows, cols = x.shape
    wide = torch.zeros(rows, cols + pitch, dtype=torch.bfloat16)
    wide[:, pitch:] = x
    out = {}
    for name, use_kernel in (("numba", True), ("torch", False)):
        values = torch.zeros(rows, cols + pitch, dtype=torch.float8_e4m3fn)[:, :cols]
        scales = torch.zeros(-(-rows // 128), -(-cols // 128))
        BlockQuantizer(rounding, use_kernel=use_kernel)(wide[:, pitch:], values, scales)
        out[name] = values.contiguous(), scales
    out["reference"] = per_block_fp8(x, rounding=rounding)
    out["device"] = quantize_on_device(x, rounding=rounding)
    return out


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    log_scale=st.integers(-30, 30),
    specials=st.lists(st.tuples(st.sampled_from(sorted(SPECIALS)), st.integers(0, 1 << 16), st.booleans()), max_size=4),
    pitch=st.integers(0, 9),
    rounding=st.sampled_from(ROUNDINGS),
    seed=st.integers(0, 2**31),
)
def test_every_path_writes_the_roundings_bytes(rows, cols, log_scale, specials, pitch, rounding, seed):
    """numba kernel, torch ops, the reference and the device path agree byte for byte with vLLM's own function as the
    rounding's platform runs it (a GPU's, reproduced by CudaArithmetic, or this CPU's), zeros, the largest bf16,
    subnormal and floored tiles, inf and NaN of either sign included; NaNs come out canonical."""
    x = _tensor(rows, cols, log_scale, specials, seed)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    for name, (values, scales) in _paths(x, rounding, pitch).items():
        assert same_bytes(values, ref_values), (name, rounding)
        assert same_bytes(scales, ref_scales), (name, rounding)
        assert not (values.view(torch.uint8) == 0xFF).any()
        assert (scales.view(torch.int32)[scales.isnan()] == NAN_SCALE_BITS).all()


def test_the_two_roundings_differ_on_about_half_the_scales():
    """The rule is not a no-op: on random data, CUDA's and IEEE's scales differ in many blocks, and so do values."""
    x = (torch.randn(1024, 2048, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    (cuda_values, cuda_scales), (ieee_values, ieee_scales) = (per_block_fp8(x, rounding=r) for r in ROUNDINGS)
    differ = (cuda_scales != ieee_scales).float().mean().item()
    assert 0.2 < differ < 0.8
    assert not torch.equal(cuda_values.view(torch.uint8), ieee_values.view(torch.uint8))


def test_block_scale_is_the_rule_on_every_float32_amax_bf16_can_give():
    """block_scale against numpy's float32 arithmetic: a multiply by fl32(1/448), or a division by 448."""
    amax = np.maximum((np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32), np.float32(1e-4))
    got_cuda = block_scale(torch.from_numpy(amax), ScaleRounding.CUDA).numpy()
    got_ieee = block_scale(torch.from_numpy(amax), ScaleRounding.IEEE).numpy()
    assert np.array_equal(got_cuda.view(np.uint32), (amax * np.float32(RECIPROCAL)).view(np.uint32))
    assert np.array_equal(got_ieee.view(np.uint32), (amax / np.float32(448.0)).view(np.uint32))
    assert not np.array_equal(got_cuda, got_ieee)


def test_an_unknown_rounding_is_refused_in_one_line():
    with pytest.raises(ValueError, match="fp8 scale rounding 'fast' is not one of cuda, ieee"):
        rounding_of("fast")
    with pytest.raises(ValueError):
        BlockQuantizer("fast")
