"""Host executor: run a plan in one process on real tensors (the reference for every other executor)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .errors import PlanMismatchError
from .plan_format import Plan, TensorEntry


def _as_tensors(destination) -> dict[str, torch.Tensor]:
    if isinstance(destination, torch.nn.Module):
        return dict(destination.named_parameters())
    return dict(destination)


def _flat(name: str, tensor: torch.Tensor, entry: TensorEntry, side: str) -> torch.Tensor:
    if tuple(tensor.shape) != entry.shape or str(tensor.dtype).removeprefix("torch.") != entry.dtype:
        raise PlanMismatchError(
            f"{side} tensor {name!r} is {str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}, "
            f"the plan expects {entry.dtype}{list(entry.shape)}"
        )
    if not tensor.is_contiguous():
        raise PlanMismatchError(f"{side} tensor {name!r} is not contiguous; plans address contiguous memory")
    return tensor.detach().view(-1)


def check_tensors(given: Mapping[str, torch.Tensor], table: tuple[TensorEntry, ...], needed: set[int], side: str) -> None:
    """Refuse before touching memory if names, shapes or dtypes differ from the plan's table."""
    names = {table[i].name for i in needed}
    missing = sorted(names - set(given))
    if missing:
        raise PlanMismatchError(f"{side} tensors missing: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    known = {entry.name for entry in table}
    extra = sorted(set(given) - known)
    if extra:
        raise PlanMismatchError(f"{side} tensors not in the plan: {', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}")
    for i in needed:
        entry = table[i]
        _flat(entry.name, given[entry.name], entry, side)


def execute_local(
    plan: Plan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    destinations: Mapping[int, object],
    *,
    only: set[str] | None = None,
) -> int:
    """Execute every (trainer rank, inference rank) pair of `plan` in this process.

    `sources` maps trainer rank to {trainer tensor name: local tensor}; `destinations` maps
    inference rank to a module (its named parameters) or a {name: tensor} dict. With `only`,
    just the runs into those destination names execute, and only their sources must be given.
    Returns the number of destination bytes written.
    """
    runs = plan.runs
    mask = np.ones(plan.n_runs, dtype=bool)
    if only is not None:
        wanted = np.array([entry.name in only for entry in plan.dests] or [False])
        mask &= wanted[runs["dest"]]
    dst_tensors = {rank: _as_tensors(d) for rank, d in destinations.items()}
    for rank in sorted(set(runs["dst_rank"][mask].tolist()) - set(dst_tensors)):
        raise PlanMismatchError(f"no destination given for inference rank {rank}")
    for rank in sorted(set(runs["src_rank"][mask].tolist()) - set(sources)):
        raise PlanMismatchError(f"no source tensors given for trainer rank {rank}")
    for rank, given in sources.items():
        needed = set(runs["src"][mask & (runs["src_rank"] == rank)].tolist())
        check_tensors(given, plan.sources, needed, f"trainer rank {rank}")
    for rank, given in dst_tensors.items():
        needed = set(runs["dest"][mask & (runs["dst_rank"] == rank)].tolist())
        if only is None:
            needed = set(range(len(plan.dests)))
        check_tensors(given, plan.dests, needed, f"inference rank {rank}")

    written = 0
    itemsizes = plan.wire_itemsize()
    chains = [[getattr(torch, d) for d in chain[1:]] for chain in plan.cast_chains]
    cols = {k: v[mask].tolist() for k, v in runs.items()}
    flat_src: dict[tuple[int, int], torch.Tensor] = {}
    flat_dst: dict[tuple[int, int], torch.Tensor] = {}
    with torch.no_grad():
        for i, (sr, dr, s, so, d, do, n, w) in enumerate(
            zip(cols["src_rank"], cols["dst_rank"], cols["src"], cols["src_off"], cols["dest"], cols["dst_off"], cols["length"], cols["wire"])
        ):
            src = flat_src.get((sr, s))
            if src is None:
                entry = plan.sources[s]
                src = flat_src[(sr, s)] = _flat(entry.name, sources[sr][entry.name], entry, "source")
            dst = flat_dst.get((dr, d))
            if dst is None:
                entry = plan.dests[d]
                dst = flat_dst[(dr, d)] = _flat(entry.name, dst_tensors[dr][entry.name], entry, "destination")
            value = src[so : so + n]
            for dtype in chains[w]:
                value = value.to(dtype)
            dst[do : do + n].copy_(value)
        written = int((runs["length"][mask] * itemsizes[mask]).sum())
    return written
