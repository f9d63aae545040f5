"""Shared fp8 test facts: the plan cases run in process and between processes, vLLM's block quantizer, byte equality."""

from __future__ import annotations

import torch

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


def vllm_per_block(x: torch.Tensor):
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
