"""Host execution of a plan's fp8 part: sender- and gather-side block quantization per trainer rank, receiver-side from bf16 staging."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..casts import cast_along
from ..fp8.numerics import quantize_span, span_dest_segments
from ..plan.format import Plan
from ..plan.schema import RECEIVER, SENDER, TRAINER_SIDES


def stage_run_rows(plan: Plan, side: int, stage: int, quant_rank: int | None = None) -> np.ndarray:
    """Indices of the stage runs of one side into one staging tensor (optionally those trainer `quant_rank` copies)."""
    t = plan.stage
    mask = (t["side"] == side) & (t["stage"] == stage)
    if quant_rank is not None:
        mask &= t["quant_rank"] == quant_rank
    return np.flatnonzero(mask)


def fill_staging(plan: Plan, rows: np.ndarray, sources: Mapping[int, Mapping[str, torch.Tensor]], out: torch.Tensor) -> int:
    """Execute stage runs `rows` into the flat bf16 tensor `out`; returns the elements copied."""
    t, flat = plan.stage, out.view(-1)
    copied = 0
    for i in rows.tolist():
        rank, src, off, dst, n, wire = (int(t[c][i]) for c in ("src_rank", "src", "src_off", "stage_off", "length", "wire"))
        value = sources[rank][plan.sources[src].name].detach().view(-1)[off : off + n]
        flat[dst : dst + n].copy_(cast_along(value, plan.cast_chains[wire]))
        copied += n
    return copied


def trainer_quantize(plan: Plan, stage: int, side: int, rank: int, sources: Mapping[int, Mapping[str, torch.Tensor]]):
    """What trainer `rank` computes for one staging tensor on one trainer side: its arena, then fp8 + scales of its spans.

    On the sender side only this rank's shards are given to it, so a sender-side block can read no
    other rank's bytes; on the gather side its stage runs name the peers it reads.
    Returns (fp8 tensor, scale tensor, span rows); only the spans' blocks are meaningful.
    """
    entry = plan.staging[stage]
    arena = torch.zeros(entry.shape, dtype=torch.bfloat16)
    given = {rank: sources[rank]} if side == SENDER else sources
    fill_staging(plan, stage_run_rows(plan, side, stage, rank), given, arena)
    weight = torch.zeros(entry.shape, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(plan.dests[entry.scale].shape, dtype=torch.float32)
    s = plan.spans
    rows = np.flatnonzero((s["stage"] == stage) & (s["side"] == side) & (s["src_rank"] == rank))
    for i in rows.tolist():
        quantize_span(arena, weight, scale, int(s["first_block"][i]), int(s["n_blocks"][i]),
                      rounding=plan.header.quant_layout.scale_rounding)
    return weight, scale, rows


def execute_quant(plan: Plan, sources, dst_tensors: dict[int, dict[str, torch.Tensor]], only: set[str] | None) -> int:
    """Produce every quantized destination of the given inference ranks; returns destination bytes written."""
    written = 0
    sender_cache: dict[tuple[int, int], tuple] = {}
    s = plan.spans
    with torch.no_grad():
        for rank, tensors in dst_tensors.items():
            for stage, entry in enumerate(plan.staging):
                weight_entry, scale_entry = plan.dests[entry.weight], plan.dests[entry.scale]
                if rank not in entry.ranks or (only is not None and not {weight_entry.name, scale_entry.name} & only):
                    continue
                weight = tensors[weight_entry.name].detach()
                scale = tensors[scale_entry.name].detach()
                # Receiver side: pull bf16 into a staging buffer, quantize the receiver's spans.
                staging = torch.zeros(entry.shape, dtype=torch.bfloat16)
                fill_staging(plan, stage_run_rows(plan, RECEIVER, stage), sources, staging)
                for i in np.flatnonzero((s["stage"] == stage) & (s["side"] == RECEIVER)).tolist():
                    quantize_span(staging, weight, scale, int(s["first_block"][i]), int(s["n_blocks"][i]),
                                  rounding=plan.header.quant_layout.scale_rounding)
                # Sender and gather sides: each trainer rank quantizes its spans once; receivers copy the fp8 bytes and scales.
                flat_w, flat_s = weight.view(-1), scale.view(-1)
                trainer_side = (s["stage"] == stage) & np.isin(s["side"], TRAINER_SIDES)
                for side, src_rank in sorted(set(zip(s["side"][trainer_side].tolist(), s["src_rank"][trainer_side].tolist()))):
                    key = (stage, side, src_rank)
                    if key not in sender_cache:
                        sender_cache[key] = trainer_quantize(plan, stage, side, src_rank, sources)
                    fp8, scales, rows = sender_cache[key]
                    fp8_flat, scale_flat = fp8.view(-1), scales.view(-1)
                    for i in rows.tolist():
                        first, count = int(s["first_block"][i]), int(s["n_blocks"][i])
                        for off, n in span_dest_segments(entry.shape, first, count):
                            flat_w[off : off + n] = fp8_flat[off : off + n]
                        flat_s[first : first + count] = scale_flat[first : first + count]
                written += weight_entry.nbytes + scale_entry.nbytes
    return written
