"""place_quant: quantize each 128x128 block on its trainer rank when that rank alone holds it, else on the receiver."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...runtime.plan_format import SPAN_COLUMNS, STAGE_COLUMNS
from ...runtime.quant import block_grid
from ..ir import Program, QuantPlacement, Runs, TensorSpec
from .quant_blocks import BlockGrids, block_intervals, block_ranges


def place_quant(program: Program) -> Program:
    """Split runs into quantized tensors off into stage runs and block spans; replace those dests by fp8 weight + scale.

    `program.meta["quant_tensors"]` maps a bf16 destination name to (fp8 weight name, scale name).
    A block whose written elements all come from one trainer rank is quantized by that rank
    (side 0) from stage runs that rank executes locally; any other block (elements from several
    ranks, or none: all padding) is quantized by every receiver holding the tensor (side 1) from
    bf16 it pulls. A run feeding blocks of both sides is listed once per side.
    """
    quantized = program.meta.get("quant_tensors", {})
    runs = program.runs
    names = np.array([spec.name in quantized for spec in program.dests] or [False], dtype=bool)
    into_quantized = names[runs.dest] & (runs.count > 1)
    if into_quantized.any():  # stage runs are plain: take strided runs into quantized tensors row by row
        runs = Runs.concat([runs.take(np.flatnonzero(~into_quantized)), runs.expand(into_quantized)])
    dests: list[TensorSpec] = []
    remap = np.full(len(program.dests), -1, dtype=np.int64)
    staging, stage_of = [], {}
    for d, spec in enumerate(program.dests):
        if spec.name not in quantized:
            remap[d] = len(dests)
            dests.append(spec)
            continue
        weight, scale = quantized[spec.name]
        _, nbr, nbc = block_grid(spec.shape)
        stage_of[d] = len(staging)
        staging.append((spec.name, spec.shape, spec.ranks, len(dests), len(dests) + 1))
        dests.append(TensorSpec(weight, spec.shape, "float8_e4m3fn", ranks=spec.ranks))
        dests.append(TensorSpec(scale, (*spec.shape[:-2], nbr, nbc), "float32", ranks=spec.ranks))
    keep = remap[runs.dest] >= 0
    kept = runs.take(np.flatnonzero(keep))
    order = np.lexsort((runs.dst_off, runs.dest))
    staged = runs.take(order[~keep[order]])  # runs into quantized tensors, by (destination, dst_off)
    stage_index = np.full(len(program.dests), -1, dtype=np.int64)
    for d, stage in stage_of.items():
        stage_index[d] = stage
    stage_cols, span_cols = _place(BlockGrids.of([shape for _, shape, _, _, _ in staging]), stage_index[staged.dest], staged)
    placement = QuantPlacement(tuple(staging), stage_cols, span_cols)
    new_runs = dataclasses.replace(kept, dest=remap[kept.dest])
    return dataclasses.replace(program, dests=tuple(dests), runs=new_runs, meta=dict(program.meta, quant_placement=placement))


def _place(grids: BlockGrids, stage: np.ndarray, runs) -> tuple[dict, dict]:
    """Stage runs and block spans for `runs` (into staging tensors `stage`, ordered by (stage, dst_off))."""
    item, lo, hi = block_intervals(grids, stage, runs.dst_off, runs.length)
    rank = runs.src_rank[item]
    # Elementary segments: between consecutive interval ends and tensor starts; each lies in one tensor.
    bounds = np.unique(np.concatenate([lo, hi, grids.base]))
    first, last = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
    n = len(bounds)

    def covering_sum(weights):
        """Per segment: the sum of `weights` over the intervals covering it (difference array, then cumsum)."""
        starts = np.bincount(first, weights=weights, minlength=n) - np.bincount(last, weights=weights, minlength=n)
        return np.rint(np.cumsum(starts)[:-1]).astype(np.int64)

    count, total, squares = covering_sum(None), covering_sum(rank), covering_sum(rank * rank)
    # All covering ranks are equal iff count * sum(r^2) == sum(r)^2; untouched blocks (count 0) go to the receiver.
    single = (count > 0) & (count * squares == total * total)
    owner = np.where(single, total // np.maximum(count, 1), -1)
    seg_stage = np.searchsorted(grids.base, bounds[:-1], side="right") - 1
    # Spans: runs of segments with one owner within one tensor.
    new = np.ones(len(owner), dtype=bool)
    new[1:] = (owner[1:] != owner[:-1]) | (seg_stage[1:] != seg_stage[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(owner)).astype(np.int64) if len(starts) else starts
    span_stage = seg_stage[starts]
    span_owner = owner[starts]
    span_cols = dict(zip(SPAN_COLUMNS, (
        span_stage,
        bounds[starts] - grids.base[span_stage],
        bounds[ends] - bounds[starts],
        np.where(span_owner >= 0, QuantPlacement.SENDER, QuantPlacement.RECEIVER),
        span_owner,
    )))
    # A run goes to the sender side if it touches a sender block, to the receiver side if it touches a receiver block.
    sender_before = np.concatenate([[0], np.cumsum(owner >= 0)])
    receiver_before = np.concatenate([[0], np.cumsum(owner < 0)])
    sends = np.bincount(item, weights=sender_before[last] - sender_before[first], minlength=len(runs)) > 0
    receives = np.bincount(item, weights=receiver_before[last] - receiver_before[first], minlength=len(runs)) > 0
    which = np.stack([sends, receives], axis=1).reshape(-1)  # per run: its sender row, then its receiver row
    row_run = np.repeat(np.arange(len(runs)), 2)[which]
    side = np.tile(np.array([QuantPlacement.SENDER, QuantPlacement.RECEIVER], dtype=np.int64), len(runs))[which]
    stage_cols = dict(zip(STAGE_COLUMNS, (
        side, runs.src_rank[row_run], runs.src[row_run], runs.src_off[row_run], stage[row_run],
        runs.dst_off[row_run], runs.length[row_run], runs.wire[row_run],
    )))
    return ({c: np.ascontiguousarray(v, dtype=np.int64) for c, v in stage_cols.items()},
            {c: np.ascontiguousarray(v, dtype=np.int64) for c, v in span_cols.items()})


def block_owners(shape: tuple[int, ...], offs, lengths, ranks) -> np.ndarray:
    """Per flat block: the one trainer rank whose runs write it, or -1 (several ranks, or none)."""
    matrices, nbr, nbc = block_grid(shape)
    owner = np.full(matrices * nbr * nbc, -1, dtype=np.int64)
    shared = np.zeros(len(owner), dtype=bool)
    for off, length, rank in zip(offs, lengths, ranks):
        for lo, hi in block_ranges(shape, off, length):
            seen = owner[lo:hi]
            shared[lo:hi] |= (seen >= 0) & (seen != rank)
            owner[lo:hi] = rank
    owner[shared] = -1
    return owner
