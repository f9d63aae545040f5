"""The one place a plan's cast chain is applied to values (host executor, fp8 staging, sender staging)."""

from __future__ import annotations

import torch


def cast_along(value: torch.Tensor, chain: tuple[str, ...]) -> torch.Tensor:
    """Cast through every dtype of `chain` after the first (the source dtype), as vLLM's loaders did."""
    for dtype in chain[1:]:
        value = value.to(getattr(torch, dtype))
    return value
