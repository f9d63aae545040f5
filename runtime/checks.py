"""Checks that the tensors a plan is run against are the ones it was compiled for, before any memory is touched."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from .errors import PlanMismatchError
from .plan.schema import dtype_name


def named_tensors(holder, buffers: Collection[str] = ()) -> dict[str, torch.Tensor]:
    """A module's parameters, and its persistent buffers named in `buffers` (vLLM loads persistent buffers from
    checkpoint tensors too, so plans may write them), or a {name: tensor} mapping, as plain tensors (DTensors give
    their local shard)."""
    items = ([*holder.named_parameters(), *((n, b) for n, b in persistent_buffers(holder) if n in buffers)]
             if isinstance(holder, torch.nn.Module) else dict(holder).items())
    out = {}
    for name, tensor in items:
        local = getattr(tensor, "to_local", None)  # torch.distributed.tensor.DTensor
        out[name] = (local() if callable(local) else tensor).detach()
    return out


def inference_names(plan, rank: int) -> set[str]:
    """Every name the plan has for inference `rank`: its destinations and the parameters vLLM's load never writes."""
    return {e.name for e in (*plan.dests, *plan.unloaded) if rank in e.ranks}


def persistent_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of every persistent buffer (what state_dict() holds besides parameters), each object once."""
    out, seen = [], set()
    for prefix, owner in module.named_modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if name not in owner._non_persistent_buffers_set and id(buffer) not in seen:
                seen.add(id(buffer))
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


def flat_view(name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: str, side: str) -> torch.Tensor:
    """The tensor as a flat view, after checking its shape, dtype and contiguity against the plan."""
    if tuple(tensor.shape) != tuple(shape) or dtype_name(tensor.dtype) != dtype:
        raise PlanMismatchError(
            f"{side} tensor {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, the plan expects {dtype}{list(shape)}"
        )
    if tensor.device.type == "meta":
        raise PlanMismatchError(f"{side} tensor {name!r} is on the meta device; give it real memory")
    if not tensor.is_contiguous():
        raise PlanMismatchError(f"{side} tensor {name!r} is not contiguous; plans address contiguous memory")
    return tensor.detach().view(-1)


MAX_VERSION = (1 << 62) - 1  # a version's sequence words (2v, 2v + 1) must fit in int64


def check_version(version) -> int:
    """A sync version: an int in 1..MAX_VERSION (ValueError otherwise)."""
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= MAX_VERSION:
        raise ValueError(f"versions are integers from 1 to 2**62 - 1, got {version!r}")
    return version


def check_rank(rank, ranks: int, side: str) -> int:
    """A rank of a plan's side: an int in 0..ranks-1 (PlanMismatchError otherwise)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks:
        raise PlanMismatchError(f"{side} rank {rank!r} is not in the plan's {ranks} {side} ranks (0..{ranks - 1})")
    return rank


def check_no_aliases(views: dict, side: str) -> None:
    """Refuse destination tensors that share memory: a sync would write some bytes twice, silently."""
    spans = sorted((int(t.data_ptr()), int(t.data_ptr()) + t.numel() * t.element_size(), key) for key, t in views.items() if t.numel())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise PlanMismatchError(f"{side} tensors {first!r} and {second!r} share memory; give each planned tensor its own")


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


def check_host_only(tensors, options: Mapping[str, bool], side: str) -> None:
    """Refuse, in one line, options whose work goes through numpy (digests, verify, delta pages) on device tensors."""
    on = sorted(name for name, enabled in options.items() if enabled)
    device = next((t.device for t in tensors if t.device.type != "cpu"), None)
    if on and device is not None:
        raise PlanMismatchError(f"{side}: {', '.join(on)} need host tensors (numpy hashes and encodes them), but its "
                                f"tensors are on {device}; run without {' and '.join(on)} (docs/operations.md, 'GPUs')")
