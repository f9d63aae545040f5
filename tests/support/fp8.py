"""Shared fp8 test facts: the plan cases run in process and between processes, vLLM's block quantizer, byte equality."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from weightplan.compiler.cuda_arithmetic import CudaArithmetic
from weightplan.runtime.fp8.rounding import ScaleRounding, canonical_nans_

CASES = {  # name -> (model, trainer format, trainer layout, inference layout)
    # 256-row tensors over 2 trainer ranks: 128-row shards, block-aligned (fused_qkv_a mixes both ranks)
    "aligned": ("fp8-glm", "hf", "fsdp=2", "tp=1"),
    # 86-row shards: blocks straddle trainer ranks and are quantized on the receiver
    "unaligned": ("fp8-glm", "hf", "fsdp=3", "tp=1"),
    # stacked experts over EP, DP-attention + EP inference
    "mixed": ("fp8-glm", "stacked", "fsdp=4,ep=2", "dp=2,ep"),
    # DeepSeek-V3 shapes: 96-wide experts padded to 128, 192-wide q_b_proj input (edge blocks), TP; unaligned
    # shards: straddling blocks of TP-sharded tensors go to the receiver, of replicated ones (q_a, kv_a) to a gatherer
    "deepseek": ("fp8-deepseek-v3", "hf", "fsdp=3", "tp=2"),
    # 86-row shards, replicated on 2 inference ranks: straddling blocks are gathered on one trainer rank
    "gathered": ("fp8-glm", "hf", "fsdp=3", "dp=2"),
}


ROUNDINGS = tuple(ScaleRounding)


def vllm_per_block(x: torch.Tensor, rounding: ScaleRounding):
    """vLLM's own per_block_cast_to_fp8, op by op (as inside the compiler's pins), on this CPU: as a GPU engine runs it
    for the CUDA rounding (compiler/cuda_arithmetic.py, whose canonical NaNs are the rule's), as a CPU engine does for
    the IEEE one, with the CPU's NaN bytes (x86's negative default NaN, input payloads) then made the canonical ones
    both rules write (runtime/fp8/rounding.py): the only bytes of a CPU engine the IEEE rule does not reproduce."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    with torch.compiler.set_stance("force_eager"), (CudaArithmetic() if rounding is ScaleRounding.CUDA else nullcontext()):
        values, scales = per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)
    if rounding is ScaleRounding.IEEE:
        canonical_nans_(values, scales)
    return values, scales


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
