"""The device fp8 quantizer (torch ops, what a GPU rank runs) on host tensors, through the same code path: bytes equal
to vLLM's per_block_cast_to_fp8 and to the numba kernel, and the runtime picks the path by device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from weightplan.runtime.fp8 import numerics
from weightplan.runtime.fp8.numerics import BlockQuantizer, quantize_on_device

from ..support.fp8 import ROUNDINGS, same_bytes, vllm_per_block


def _data(shape, scale, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


# One tile, whole tiles, a partial tile on one edge, partial tiles on both.
@pytest.mark.parametrize("shape", [(128, 128), (384, 256), (5, 300), (129, 257)])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 3e4])
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_device_path_matches_vllm(shape, scale, rounding):
    x = _data(shape, scale, sum(shape))
    values, scales = quantize_on_device(x, rounding=rounding)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_device_path_matches_vllm_on_special_tiles(rounding):
    x = _data((512, 384), 1.0, 7)
    x[:128, :128] = 0
    x[128:256, :128] = torch.finfo(torch.bfloat16).max
    x[:128, 128:256] = -torch.finfo(torch.bfloat16).tiny
    x[256:384, 256:] = float("inf")
    x[384:, :128] = float("nan")
    x[385, 5] = -float("nan")
    values, scales = quantize_on_device(x, rounding=rounding)
    ref_values, ref_scales = vllm_per_block(x, rounding)
    assert same_bytes(values, ref_values) and same_bytes(scales, ref_scales)
    assert not torch.isfinite(scales[2:]).all() and (values.view(torch.uint8) != 0xFF).all()


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_device_path_equals_the_numba_kernel_and_never_calls_it(monkeypatch, rounding):
    x = _data((1024, 768), 0.05, 3)
    kernel_values = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    kernel_scales = torch.empty(8, 6)
    BlockQuantizer(rounding)(x, kernel_values, kernel_scales)

    def no_kernel(*args):
        raise AssertionError("the device path must not use the numba kernel")

    monkeypatch.setattr(BlockQuantizer, "_kernel_tiles", no_kernel)
    values, scales = quantize_on_device(x, rounding=rounding)
    assert same_bytes(values, kernel_values) and same_bytes(scales, kernel_scales)
    assert numerics.TorchTiles is not None


def test_the_runtime_picks_the_path_by_device():
    """Host tensors take the numba kernel; tensors on another device (meta here, a GPU's on a GPU) the torch ops."""
    quantize = BlockQuantizer("cuda")
    x = _data((256, 256), 1.0, 1)
    assert quantize._kernel_tiles(x, torch.empty(256, 256, dtype=torch.float8_e4m3fn), torch.empty(2, 2), 256, 256)
    meta = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    assert not quantize._kernel_tiles(meta, torch.empty(256, 256, dtype=torch.float8_e4m3fn, device="meta"),
                                      torch.empty(2, 2, device="meta"), 256, 256)
    values, scales = quantize_on_device(meta, rounding="cuda")
    assert values.device.type == scales.device.type == "meta"


def test_a_ranks_fp8_work_stays_on_its_tensors_device(plan_cache):
    """Meta tensors stand in for a GPU's: everything SenderQuant, TrainerGather and ReceiverQuant allocate is on the
    tensors' device, and a publish's gathers and quantization and a receiver's per-group quantization run there (an
    index or operand left in host memory makes index_copy_ and the quantizer's arithmetic raise, on meta as on CUDA).
    DeepSeek-V3 shapes over fsdp=3 / tp=2 have sender-, gather- and receiver-side blocks and edge blocks."""
    from weightplan.runtime import load_plan
    from weightplan.runtime.fp8.placement import Fp8Placement
    from weightplan.runtime.receiver.quant import ReceiverQuant
    from weightplan.runtime.sender.quant import SenderQuant
    from weightplan.runtime.sender.trainer_gather import TrainerGather
    from weightplan.runtime.tables.quant import exposed_regions, quant_tables
    from weightplan.runtime.tables.receiver import read_groups

    from ..support.fp8 import CASES

    meta = torch.device("meta")
    placement = Fp8Placement(meta, kernel=False)
    plan = load_plan(plan_cache(*CASES["deepseek"][:2], "bf16", *CASES["deepseek"][2:], quant="fp8_per_block")).pulling
    tables = quant_tables(plan)
    sides = set()
    for rank in range(plan.header.src_ranks):
        regions = exposed_regions(plan, tables, rank)
        sources = {s: torch.empty(int(np.prod(plan.local_shape(s, rank))), dtype=getattr(torch, plan.sources[s].dtype),
                                  device=meta) for s in range(len(plan.sources))}
        exposed = [torch.empty(r.numel, dtype=getattr(torch, r.wire_dtype), device=meta) if r.staged else sources[r.source]
                   for r in regions]
        gather = TrainerGather(plan, rank, tables, meta) if len(tables.gathered(rank)) else None
        quant = SenderQuant(plan, rank, tables, regions, exposed, sources, placement,
                            *((gather.buffer, gather.offset) if gather else ()))
        held = [quant.arena, *quant.registered, *(gather.registered[:1] if gather else [])]
        held += [index for _, _, src_idx, dst_idx in (g for step in quant._windows for g in step[2]) for index in (src_idx, dst_idx)]
        held += [index for _, src_idx, dst_idx in quant._pack.steps for index in (src_idx, dst_idx)]
        assert {t.device for t in held} == {meta}, rank
        quant.publish()
        sides |= {"sender" if len(quant.pieces) else None, "gather" if gather else None}
    for rank in range(plan.header.dst_ranks):
        dst = {i: torch.empty(e.numel, dtype=getattr(torch, e.dtype), device=meta)
               for i, e in enumerate(plan.dests) if rank in e.ranks}
        quant = ReceiverQuant(plan, rank, tables, dst, placement)
        groups = read_groups(plan, rank, 64 << 10, quant.grouping())
        quant.place(groups.stage_group, groups.n_groups)
        assert {s.device for s in quant.slots} == {meta}
        for group in range(groups.n_groups):
            quant.quantize(group)
        sides |= {"receiver" if quant.quantizes else None}
    assert sides - {None} == {"sender", "gather", "receiver"}


def test_a_triton_kernel_that_cannot_run_leaves_the_tiles_to_torch_ops(monkeypatch, caplog):
    """On a GPU whole tiles go to the Triton kernel; where it cannot run (no Triton, a compile error) the quantizer
    warns once, never tries it again, and leaves the tiles to torch ops (whose bytes the tests above prove equal).
    Here a host tensor says it lives on cuda:0."""
    from weightplan.runtime.fp8 import triton_quant

    from ..support.fake_nixl import on_cuda

    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(triton_quant, "quantize_tiles_triton", broken)
    x = on_cuda(_data((256, 384), 0.05, 4), 0)
    values, scales = torch.empty(256, 384, dtype=torch.float8_e4m3fn), torch.empty(2, 3)
    quantize = BlockQuantizer("cuda")
    with caplog.at_level("WARNING", logger="weightplan.runtime"):
        assert not quantize._triton_tiles(x, values, scales, 256, 384)
        assert not quantize._triton_tiles(x, values, scales, 256, 384)
    assert len(calls) == 1 and quantize._triton_failed == "RuntimeError: PTX compile failed"
    assert sum("Triton kernel is unavailable" in r.message for r in caplog.records) == 1
    assert not BlockQuantizer("cuda")._triton_tiles(_data((256, 384), 0.05, 4), values, scales, 256, 384)  # host: never
