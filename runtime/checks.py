"""Checks that the tensors a plan is run against are the ones it was compiled for, before any memory is touched."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import PlanMismatchError


def dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def named_tensors(holder) -> dict[str, torch.Tensor]:
    """A module's parameters (DTensors give their local shard) or a {name: tensor} mapping, as plain tensors."""
    items = holder.named_parameters() if isinstance(holder, torch.nn.Module) else dict(holder).items()
    out = {}
    for name, tensor in items:
        local = getattr(tensor, "to_local", None)  # torch.distributed.tensor.DTensor
        out[name] = (local() if callable(local) else tensor).detach()
    return out


def flat_view(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: str, side: str) -> torch.Tensor:
    """The tensor as a flat view, after checking its shape, dtype and contiguity against the plan."""
    if tuple(tensor.shape) != tuple(shape) or dtype_name(tensor) != dtype:
        raise PlanMismatchError(
            f"{side} tensor {name!r} is {dtype_name(tensor)}{list(tensor.shape)}, the plan expects {dtype}{list(shape)}"
        )
    if tensor.device.type == "meta":
        raise PlanMismatchError(f"{side} tensor {name!r} is on the meta device; give it real memory")
    if not tensor.is_contiguous():
        raise PlanMismatchError(f"{side} tensor {name!r} is not contiguous; plans address contiguous memory")
    return tensor.detach().view(-1)


def check_tensors(given: Mapping[str, torch.Tensor], expected: dict[str, tuple], known: set[str], side: str) -> None:
    """Refuse if names, shapes or dtypes differ from the plan.

    `expected` maps each needed name to (shape, dtype); `known` is every name the plan has for this side.
    """
    missing = sorted(set(expected) - set(given))
    if missing:
        raise PlanMismatchError(f"{side} tensors missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    extra = sorted(set(given) - known)
    if extra:
        raise PlanMismatchError(f"{side} tensors not in the plan: {', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}")
    for name, (shape, dtype) in expected.items():
        flat_view(name, given[name], shape, dtype, side)
