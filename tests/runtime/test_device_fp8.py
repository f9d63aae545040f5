"""The device fp8 quantizer (torch ops, what a GPU rank runs) on host tensors, through the same code path: bytes equal
to vLLM's per_block_cast_to_fp8 and to the numba kernel, and the runtime picks the path by device."""

from __future__ import annotations

import pytest
import torch

from weightplan.runtime.fp8 import numerics
from weightplan.runtime.fp8.numerics import BlockQuantizer, quantize_on_device

from ..support.fp8 import same_bytes, vllm_per_block


def _data(shape, scale, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (1, 1), (5, 300), (300, 5), (129, 257), (2048, 640)])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
def test_device_path_matches_vllm(shape, scale):
    x = _data(shape, scale, sum(shape))
    values, scales = quantize_on_device(x)
    ref_values, ref_scales = vllm_per_block(x)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)


def test_device_path_matches_vllm_on_special_tiles():
    x = _data((512, 384), 1.0, 7)
    x[:128, :128] = 0
    x[128:256, :128] = torch.finfo(torch.bfloat16).max
    x[:128, 128:256] = -torch.finfo(torch.bfloat16).tiny
    x[256:384, 256:] = float("inf")
    x[384:, :128] = float("nan")
    values, scales = quantize_on_device(x)
    ref_values, ref_scales = vllm_per_block(x)
    finite = torch.isfinite(ref_scales)
    assert same_bytes(scales[finite], ref_scales[finite]) and bool(torch.isnan(scales[~finite]).all() == torch.isnan(ref_scales[~finite]).all())
    rows = slice(0, 256)  # tiles of finite scale: byte-exact values
    assert same_bytes(values[rows], ref_values[rows])


def test_device_path_equals_the_numba_kernel_and_never_calls_it(monkeypatch):
    x = _data((1024, 768), 0.05, 3)
    kernel_values = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    kernel_scales = torch.empty(8, 6)
    BlockQuantizer()(x, kernel_values, kernel_scales)

    def no_kernel(*args):
        raise AssertionError("the device path must not use the numba kernel")

    monkeypatch.setattr(BlockQuantizer, "_kernel_tiles", no_kernel)
    values, scales = quantize_on_device(x)
    assert same_bytes(values, kernel_values) and same_bytes(scales, kernel_scales)
    assert numerics.TorchTiles is not None


def test_the_runtime_picks_the_path_by_device():
    """Host tensors take the numba kernel; tensors on another device (meta here, a GPU's on a GPU) the torch ops."""
    quantize = BlockQuantizer()
    x = _data((256, 256), 1.0, 1)
    assert quantize._kernel_tiles(x, torch.empty(256, 256, dtype=torch.float8_e4m3fn), torch.empty(2, 2), 256, 256)
    meta = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    assert not quantize._kernel_tiles(meta, torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                      torch.empty(2, 2, device="meta"), 256, 256)
    values, scales = quantize_on_device(meta)
    assert values.device.type == scales.device.type == "meta"
