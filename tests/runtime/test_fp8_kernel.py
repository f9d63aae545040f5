"""runtime/fp8/kernel.py: its float32 -> e4m3fn rounding against torch, and BlockQuantizer with it against vLLM."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime.fp8.kernel import f32_bits_to_e4m3fn, scaled_bf16_to_e4m3fn
from weightplan.runtime.fp8.numerics import BlockQuantizer

from weightplan.runtime.fp8.rounding import RECIPROCAL, ScaleRounding

from ..support.fp8 import ROUNDINGS, same_bytes, vllm_per_block

BF16_MAX = torch.finfo(torch.bfloat16).max


def test_e4m3fn_rounding_equals_torch_on_every_float32():
    """All 2**32 float32 bit patterns (both signs, zeros, subnormals, every rounding tie, the saturation band
    (448, 480), infinities and every NaN payload), in chunks of 2**24: about 20 s on the 2-core test machine."""
    n = 1 << 24
    out = np.empty(n, dtype=np.uint8)
    for start in range(0, 1 << 32, n):
        bits = np.arange(start, start + n, dtype=np.uint32)
        f32_bits_to_e4m3fn(bits, out)
        ref = torch.from_numpy(bits.view(np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        bad = np.flatnonzero(out != ref)
        assert bad.size == 0, f"float32 bits {bits[bad[0]]:#010x}: kernel {out[bad[0]]:#04x}, torch {ref[bad[0]]:#04x}"


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_finite_tile_products_stay_within_one_ulp_of_448(rounding):
    """What lets finite tiles skip the saturating steps: for every finite bf16 amax (and so every |x| <= amax),
    amax * (1 / scale(max(amax, 1e-4))) in float32, as the kernel computes it under either rounding, is at most 448 plus
    one ulp."""
    amax = (np.arange(0x7F80, dtype=np.uint32) << 16).view(np.float32)
    floored = np.maximum(amax, np.float32(1e-4))
    scale = floored * np.float32(RECIPROCAL) if rounding is ScaleRounding.CUDA else floored / np.float32(448.0)
    assert scale.dtype == np.float32
    inv = np.float32(1.0) / scale
    assert (amax * inv).max() <= np.nextafter(np.float32(448.0), np.float32(np.inf))


@pytest.mark.parametrize("amax_bits", [0x0001, 0x0080, 0x38D1, 0x3C00, 0x3F80, 0x3FFF, 0x4480, 0x7F7F])
def test_scaled_bf16_cast_equals_torch_on_every_bf16(amax_bits):
    """The finite-tile cast against torch: every bf16 bit pattern (both signs, zeros, subnormals) whose product
    with the inverse scale of a tile with this amax, or a float32 neighbour of it, stays below 464."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    amax = np.float32((np.uint32(amax_bits) << 16).view(np.float32))
    inv = np.float32(1.0) / (max(amax, np.float32(1e-4)) / np.float32(448.0))
    for scale_by in (inv, np.nextafter(inv, np.float32(0.0)), np.nextafter(inv, np.float32(np.inf))):
        out = np.empty(halves.size, dtype=np.uint8)
        scaled_bf16_to_e4m3fn(halves, scale_by, out)
        product = torch.from_numpy(halves.view(np.int16)).view(torch.bfloat16).float() * float(scale_by)
        ref = product.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        in_range = (product.abs() < 464).numpy()
        assert in_range.sum() > 20000
        bad = np.flatnonzero((out != ref) & in_range)
        assert bad.size == 0, f"bf16 {halves[bad[0]]:#06x} * {scale_by}: kernel {out[bad[0]]:#04x}, torch {ref[bad[0]]:#04x}"


def _quantize(x: torch.Tensor, rounding: ScaleRounding, use_kernel: bool = True, out_pad: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockQuantizer on x into fp8 values that are a view with a wider row pitch (out_pad extra columns)."""
    rows, cols = x.shape
    values = torch.zeros(rows, cols + out_pad, dtype=torch.float8_e4m3fn)[:, out_pad:]
    scales = torch.zeros(-(-rows // 128), -(-cols // 128))
    BlockQuantizer(rounding, use_kernel=use_kernel)(x, values, scales)
    return values, scales


def _check(x: torch.Tensor, out_pad: int = 0) -> None:
    """Under each rounding, the kernel path gives vLLM's bytes and the torch path's bytes."""
    for rounding in ROUNDINGS:
        values, scales = _quantize(x, rounding, out_pad=out_pad)
        ref_values, ref_scales = vllm_per_block(x.contiguous(), rounding)
        assert same_bytes(values.contiguous(), ref_values) and same_bytes(scales, ref_scales), rounding
        torch_values, torch_scales = _quantize(x, rounding, use_kernel=False)
        assert same_bytes(values.contiguous(), torch_values.contiguous()) and same_bytes(scales, torch_scales), rounding


def _embedded(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """x as a view with a larger row pitch: columns [left, left + cols) of a wider buffer."""
    wide = torch.full((x.shape[0], x.shape[1] + left + right), 7.0, dtype=x.dtype)
    wide[:, left : left + x.shape[1]] = x
    return wide[:, left : left + x.shape[1]]


@settings(max_examples=20, deadline=None)  # vLLM recompiles its torch.compile per shape class: ~1 min
@given(
    rows=st.integers(1, 400),
    cols=st.integers(1, 400),
    log_scale=st.integers(-6, 4),
    left=st.integers(0, 9),
    right=st.integers(0, 140),
    out_pad=st.integers(0, 5),
    seed=st.integers(0, 2**31),
)
def test_kernel_matches_vllm_on_random_strided_views(rows, cols, log_scale, left, right, out_pad, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 10.0**log_scale).to(torch.bfloat16)
    _check(_embedded(x, left, right), out_pad)


@pytest.mark.parametrize("shape", [(128, 128), (256, 7168), (640, 384), (1000, 700)])
def test_kernel_matches_vllm_with_column_scales_from_1e_6_to_1e4(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1])) * torch.logspace(-6, 4, shape[1])
    _check(x.to(torch.bfloat16))


def test_kernel_matches_vllm_on_expert_stack_views():
    """Each expert of a 3-D stack, a slice of its columns, and the stack flattened to (experts * rows, cols)."""
    stack = (torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    for e in range(stack.shape[0]):
        _check(stack[e])
        _check(stack[e, :, 128:])
    _check(stack.view(-1, stack.shape[-1]))


def test_kernel_matches_vllm_on_extreme_and_special_blocks():
    """Zero blocks, -0 blocks, bf16 max, bf16 subnormals, amax below the 1e-4 floor, values near 448 * scale."""
    x = torch.randn(512, 640, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[:128, :128] = 0
    x[:128, 128:256] = -0.0
    x[128:256, :128] = BF16_MAX
    x[128:256, 128:256] *= BF16_MAX / 8
    x[128:256, 130] = -BF16_MAX
    x[256:384, :128] = torch.tensor(2.0**-133).to(torch.bfloat16) * torch.randint(-127, 128, (128, 128))
    x[256:384, 128:256] = 3e-5
    x[384:, :256] = torch.linspace(-1.0, 1.0, 128 * 256).view(128, 256) * 447.9
    _check(x)
    _check(_embedded(x, 3, 200), out_pad=2)


@pytest.mark.parametrize("special", [float("inf"), -float("inf")])
def test_kernel_matches_vllm_on_infinite_inputs(special):
    """Tiles with inf: the kernel leaves them to the torch path, which gives vLLM's bytes (zeros and NaN)."""
    x = torch.randn(384, 300, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    x[5, 7] = special
    x[200, 131] = -special
    _check(x)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_nan_tiles_are_canonical_nan(rounding):
    """Tiles with NaN (either sign) come out NaN with the canonical bytes (every value 0x7f, the scale 0x7fffffff) on
    both BlockQuantizer paths, as vLLM's own function gives them on a GPU (CudaArithmetic); other tiles are vLLM's."""
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[5, 7] = float("nan")
    x[130, 300] = -float("nan")
    values, scales = _quantize(x, rounding)
    torch_values, torch_scales = _quantize(x, rounding, use_kernel=False)
    assert same_bytes(values, torch_values) and same_bytes(scales, torch_scales)
    nan_tile = torch.zeros(2, 3, dtype=torch.bool)
    nan_tile[0, 0] = nan_tile[1, 2] = True
    assert torch.equal(scales.isnan(), nan_tile)
    assert (scales.view(torch.int32)[nan_tile] == 0x7FFFFFFF).all()
    tiles = nan_tile.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert (values.view(torch.uint8)[tiles] == 0x7F).all()
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)


def test_column_strided_input_falls_back_to_torch():
    """A transposed view (no unit column stride) cannot go to the kernel; the result is still vLLM's."""
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    values, scales = _quantize(x.t(), ScaleRounding.CUDA)
    ref_values, ref_scales = vllm_per_block(x.t().contiguous(), ScaleRounding.CUDA)
    assert same_bytes(values.contiguous(), ref_values) and same_bytes(scales, ref_scales)


def test_warm_up_loads_the_kernel_before_the_first_quantization():
    """Sender and receiver call warm_up at construction, so the first sync does not load numba's kernel."""
    code = ("from weightplan.runtime.fp8 import kernel as fp8_kernel\n"
            "from weightplan.runtime.fp8.numerics import BlockQuantizer\n"
            "assert not fp8_kernel.quantize_tiles.signatures\n"
            "BlockQuantizer('cuda').warm_up()\n"
            "assert len(fp8_kernel.quantize_tiles.signatures) == 1\n"
            "BlockQuantizer('ieee').warm_up()\n"
            "assert len(fp8_kernel.quantize_tiles.signatures) == 1\n"
            "BlockQuantizer('cuda', use_kernel=False).warm_up()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_tensors_off_the_cpu_take_the_torch_path():
    """The kernel reads host memory through numpy; other devices (here meta, as a GPU trainer's tensors) use torch ops."""
    x = torch.empty(256, 384, dtype=torch.bfloat16, device="meta")
    values = torch.empty(256, 384, dtype=torch.float8_e4m3fn, device="meta")
    scales = torch.empty(2, 3, device="meta")
    BlockQuantizer("cuda")(x, values, scales)  # the kernel path would fail converting meta tensors to numpy
    assert not BlockQuantizer("cuda")._kernel_tiles(x, values, scales, 256, 384)
