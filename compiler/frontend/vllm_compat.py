"""vLLM helpers the compiler and the tests read that older supported vLLMs lack, with the same rule where they do."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch


def is_deferred_attention_layer(module: torch.nn.Module) -> bool:
    """vLLM's own test (0.32) of an attention layer whose post-load step runs after the others; vLLM 0.26's loader
    applies that step to Attention, MLAAttention and MMEncoderAttention (model_loader/utils.py), the same rule."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer as vllms
    except ImportError:
        from vllm.model_executor.layers.attention import Attention, MLAAttention, MMEncoderAttention

        return isinstance(module, (Attention, MLAAttention, MMEncoderAttention)) and callable(
            getattr(module, "process_weights_after_loading", None))
    return vllms(module)


def _tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from vllm.model_executor.parameter import SharedWeightParameter

    if isinstance(tensor, SharedWeightParameter):
        for index, partition in tensor.partitions.items():
            yield from _tensors(f"{name}.{index}", partition)
    elif is_traceable_wrapper_subclass(tensor):
        for attr in tensor.__tensor_flatten__()[0]:
            yield from _tensors(f"{name}.{attr}", getattr(tensor, attr))
    else:
        yield name, tensor


def compute_tensor_digests(model) -> dict[str, str]:
    """SHA-256 of each named parameter's bytes: vLLM's `weight_checksum.compute_tensor_digests` where it exists
    (0.32), else the same computation (vLLM 0.26 has no weight_checksum module)."""
    try:
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests as vllms
    except ImportError:
        return {name: hashlib.sha256(weight.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
                for param_name, param in model.named_parameters() for name, weight in _tensors(param_name, param)}
    return vllms(model)
