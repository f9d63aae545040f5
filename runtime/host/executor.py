"""Host executor: run a plan in one process on real tensors (the reference for every other executor)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..casts import cast_along
from ..checks import check_tensors, inference_names, named_tensors
from ..constant_writes import write_constants
from ..errors import PlanMismatchError
from ..plan.format import Plan
from ..plan.schema import RUN_COLUMNS
from ..tables.fanout import second_hops
from .quant import execute_quant


def execute_local(
    plan: Plan,
    sources: Mapping[int, Mapping[str, torch.Tensor]],
    destinations: Mapping[int, object],
    *,
    only: set[str] | None = None,
) -> int:
    """Execute every (trainer rank, inference rank) pair of `plan` in this process.

    `sources` maps trainer rank to {trainer tensor name: that rank's local shard}; `destinations`
    maps inference rank to a module (its named parameters) or a {name: tensor} dict. Inference
    ranks not given are skipped; every trainer rank their runs read must be given. With `only`,
    just the runs into those destination names execute. The plan's constants are written on every
    call. With node-local fan-out (`plan.fanout`), a rank takes its first hops from the trainers and
    reads its second-hop entries whole from its node's puller, whose destination must be given too.
    Returns the destination bytes written (runs, constants and second hops).
    """
    dst_tensors = {rank: named_tensors(d, {e.name for e in plan.dests}) for rank, d in destinations.items()}
    unknown = sorted(set(dst_tensors) - set(range(plan.header.dst_ranks)))
    if unknown:
        raise PlanMismatchError(f"inference ranks {unknown} are not in the plan's {plan.header.dst_ranks} ranks")
    for rank, tensors in dst_tensors.items():
        entries = [e for e in plan.dests if rank in e.ranks]
        expected = {e.name: (e.shape, e.dtype) for e in entries if only is None or e.name in only}
        check_tensors(tensors, expected, inference_names(plan, rank), f"inference rank {rank}")
    hops = {rank: second_hops(plan, rank) for rank in dst_tensors}
    absent = sorted({(p, rank) for rank, by in hops.items() for p in by if p not in dst_tensors})
    if absent:
        puller, rank = absent[0]
        raise PlanMismatchError(f"inference rank {rank} reads entries from inference rank {puller} of its node (a second "
                                f"hop of the plan's fan-out): give rank {puller}'s destination too")
    written = _first_hops(plan.pulling, sources, dst_tensors, only)
    with torch.no_grad():
        for rank, by in hops.items():
            for puller, dests in by.items():
                for d in dests:
                    name = plan.dests[d].name
                    if only is None or name in only:
                        target = dst_tensors[rank][name].detach()
                        target.copy_(dst_tensors[puller][name].detach())
                        written += target.numel() * target.element_size()
    return written


def _first_hops(plan: Plan, sources, dst_tensors: dict[int, dict[str, torch.Tensor]], only: set[str] | None) -> int:
    """Every run, constant and fp8 block the given inference ranks take from the trainers (`plan` as the trainers serve it)."""
    runs = plan.table
    masks = {}
    for rank in dst_tensors:
        wanted = np.zeros(len(plan.dests) + 1, dtype=bool)
        wanted[[i for i, e in enumerate(plan.dests) if rank in e.ranks and (only is None or e.name in only)]] = True
        masks[rank] = wanted[runs["dest"]]
    any_mask = np.zeros(plan.n_stored_runs, dtype=bool)
    for mask in masks.values():
        any_mask |= mask
    stage_mask = _stage_mask(plan, set(dst_tensors), only)
    for src_rank in sorted(set(runs["src_rank"][any_mask].tolist()) | set(plan.stage["src_rank"][stage_mask].tolist())):
        if src_rank not in sources:
            raise PlanMismatchError(f"no source tensors given for trainer rank {src_rank}")
    for src_rank, given in sources.items():
        needed = set(runs["src"][any_mask & (runs["src_rank"] == src_rank)].tolist())
        needed |= set(plan.stage["src"][stage_mask & (plan.stage["src_rank"] == src_rank)].tolist())
        expected = {plan.sources[i].name: (plan.local_shape(i, src_rank), plan.sources[i].dtype) for i in needed}
        check_tensors(given, expected, {e.name for e in plan.sources}, f"trainer rank {src_rank}")

    itemsizes = plan.stored_itemsize()
    written = 0
    with torch.no_grad():
        for rank, mask in masks.items():
            cols = [runs[c][mask].tolist() for c in RUN_COLUMNS]
            flat_src: dict[tuple[int, int], torch.Tensor] = {}
            flat_dst: dict[int, torch.Tensor] = {}
            for sr, s, so, d, do, n, w, count, s_stride, d_stride in zip(*cols):
                src = flat_src.get((sr, s))
                if src is None:
                    entry = plan.sources[s]
                    src = flat_src[(sr, s)] = sources[sr][entry.name].detach().view(-1)
                dst = flat_dst.get(d)
                if dst is None:
                    dst = flat_dst[d] = dst_tensors[rank][plan.dests[d].name].detach().view(-1)
                value = cast_along(rows_view(src, so, n, count, s_stride), plan.cast_chains[w])
                rows_view(dst, do, n, count, d_stride).copy_(value)
            written += int((runs["count"][mask] * runs["length"][mask] * itemsizes[mask]).sum())
            written += write_constants(plan, rank, lambda d: dst_tensors[rank][plan.dests[d].name].detach().view(-1), only)
    if plan.staging:
        written += execute_quant(plan, sources, dst_tensors, only)
    return written


def rows_view(flat: torch.Tensor, offset: int, length: int, count: int, stride: int) -> torch.Tensor:
    """Rows [offset + i*stride, +length) of a flat tensor, i < count, as one (count, length) view."""
    if count == 1:
        return flat[offset : offset + length]
    return flat.as_strided((count, length), (stride, 1), flat.storage_offset() + offset)


def _stage_mask(plan: Plan, ranks: set[int], only: set[str] | None) -> np.ndarray:
    """Stage runs needed by the given inference ranks (restricted to `only` destination names)."""
    wanted = np.zeros(len(plan.staging) + 1, dtype=bool)
    for i, entry in enumerate(plan.staging):
        names = {plan.dests[entry.weight].name, plan.dests[entry.scale].name}
        wanted[i] = bool(ranks & set(entry.ranks)) and (only is None or bool(names & only))
    return wanted[plan.stage["stage"]]
