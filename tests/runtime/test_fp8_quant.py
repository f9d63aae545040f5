"""runtime/fp8/numerics.py against vLLM's per_block_cast_to_fp8: identical bytes on random data, whole tensors and sub-blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.runtime.fp8.numerics import block_grid, per_block_fp8, quantize_span, span_dest_segments, span_elements

from ..support.fp8 import ROUNDINGS, same_bytes, vllm_per_block


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (1, 1), (5, 300), (300, 5), (129, 257), (448, 256)])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e4])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_whole_tensor_matches_vllm(shape, scale, rounding):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * scale).to(torch.bfloat16)
    values, scales = per_block_fp8(x, rounding=rounding)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_zero_and_extreme_blocks_match_vllm(rounding):
    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    x[128:, :128] = torch.finfo(torch.bfloat16).max
    x[:128, 128:] = -3e-5
    values, scales = per_block_fp8(x, rounding=rounding)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)


@settings(max_examples=15, deadline=None)
@given(
    experts=st.integers(1, 3),
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    rounding=st.sampled_from(ROUNDINGS),
    data=st.data(),
)
def test_any_span_quantizes_like_vllm_on_the_whole_tensor(experts, rows, cols, rounding, data):
    shape = (experts, rows, cols)
    matrices, nbr, nbc = block_grid(shape)
    total = matrices * nbr * nbc
    first = data.draw(st.integers(0, total - 1))
    count = data.draw(st.integers(1, total - first))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(rows * 1000 + cols)).to(torch.bfloat16)
    weight = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    scale = torch.zeros((experts, nbr, nbc), dtype=torch.float32)
    quantize_span(x, weight, scale, first, count, rounding=rounding)
    ref = [vllm_per_block(x[e], rounding) for e in range(experts)]
    ref_w = torch.stack([r[0] for r in ref]).view(-1).view(torch.uint8)
    ref_s = torch.stack([r[1] for r in ref]).view(-1)
    touched = torch.zeros(x.numel(), dtype=torch.bool)
    for off, n in span_dest_segments(shape, first, count):
        touched[off : off + n] = True
    assert int(touched.sum()) == span_elements(shape, first, count)
    got_w = weight.view(-1).view(torch.uint8)
    assert torch.equal(got_w[touched], ref_w[touched])
    assert torch.equal(got_w[~touched], torch.zeros_like(got_w[~touched]))  # nothing outside the span is written
    assert torch.equal(scale.view(-1)[first : first + count], ref_s[first : first + count])
    assert (scale.view(-1)[:first] == 0).all() and (scale.view(-1)[first + count :] == 0).all()


def test_runtime_quant_imports_no_compiler_or_vllm():
    import subprocess
    import sys

    code = ("import sys, weightplan.runtime.fp8.numerics, weightplan.runtime.host.quant, weightplan.runtime.tables.quant, "
            "weightplan.runtime.sender.quant, weightplan.runtime.receiver.quant; "
            "bad = [m for m in sys.modules if m.startswith(('weightplan.compiler', 'vllm'))]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (1, 1), (5, 300), (300, 5), (129, 257), (1000, 700)])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_block_quantizer_on_strided_views_matches_vllm(shape, rounding):
    """BlockQuantizer (the runtime's fast path) on views with a row pitch, into views with another, small chunks."""
    from weightplan.runtime.fp8.numerics import BlockQuantizer

    rows, cols = shape
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(rows + cols)) * torch.logspace(-6, 4, cols)).to(torch.bfloat16)
    wide = torch.zeros(rows, cols + 77, dtype=torch.bfloat16)
    wide[:, 13 : 13 + cols] = x
    values = torch.zeros(rows, cols + 50, dtype=torch.float8_e4m3fn)[:, 7 : 7 + cols]
    scales = torch.zeros(-(-rows // 128), -(-cols // 128))
    BlockQuantizer(rounding, chunk_elements=1 << 14)(wide[:, 13 : 13 + cols], values, scales)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values.contiguous(), ref_values) and same_bytes(scales, ref_scales)
