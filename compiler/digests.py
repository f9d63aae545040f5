"""What verify-plan and its LoRA variant share: destinations that show unwritten bytes, and vLLM's digests compared."""

from __future__ import annotations

import torch


class _Params:
    """The slice of a model compute_tensor_digests looks at: named_parameters()."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params

    def named_parameters(self):
        return iter(self._params.items())


def poisoned(entry) -> torch.Tensor:
    """A destination tensor whose bytes are all 0x7f (NaN in bf16/fp8 e4m3, a large float32): unwritten bytes show."""
    tensor = torch.empty(entry.shape, dtype=getattr(torch, entry.dtype))
    tensor.view(-1).view(torch.uint8).fill_(0x7F)
    return tensor


def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """vLLM's own SHA-256 digest of each named tensor (compute_tensor_digests, which reads a model's parameters)."""
    from .frontend.vllm_compat import compute_tensor_digests

    return compute_tensor_digests(_Params(tensors))


def compare_digests(reference: dict[str, torch.Tensor], planned: dict[str, torch.Tensor], rank: int) -> tuple[list[str], list[str]]:
    """(mismatching, compared) "name (inference rank k)" of the reference tensors, by vLLM's SHA-256 digests."""
    expected, actual = tensor_digests(reference), tensor_digests(planned)
    return ([f"{name} (inference rank {rank})" for name in sorted(expected) if expected[name] != actual.get(name)],
            [f"{name} (inference rank {rank})" for name in sorted(expected)])
