"""place_quant: quantize each 128x128 block on the trainer rank alone holding it, on one gathering trainer rank, or on the receiver."""

from __future__ import annotations

import dataclasses

import numpy as np

from weightplan.runtime.fp8.numerics import BLOCK, block_grid
from weightplan.runtime.plan.columns import BlockSpans, StageRuns
from weightplan.runtime.plan.schema import SPAN_COLUMNS, STAGE_COLUMNS, Side
from ..ir import Program, QuantPlacement, Runs, TensorEntry
from .quant_blocks import BlockGrids, block_intervals


def place_quant(program: Program) -> Program:
    """Split runs into quantized tensors off into stage runs and block spans; replace those dests by fp8 weight + scale.

    `program.quant_targets` name the bf16 destinations vLLM quantizes and their fp8 weight and scale.
    A block whose written elements all come from one trainer rank is quantized by that rank
    (Side.SENDER) from stage runs that rank executes locally. A block written by several trainer ranks
    of a tensor that several inference ranks hold is quantized (Side.GATHER) by one trainer rank writing
    in its block row, the least loaded so far, which reads the others' bf16 once. Any other block
    (one holder, or no written element: all padding) is quantized by every receiver holding the
    tensor (Side.RECEIVER) from bf16 it pulls. A run is listed once per (side, quantizing rank) of the blocks it feeds.
    """
    quantized = program.quantized()
    runs = program.runs
    names = np.array([spec.name in quantized for spec in program.dests] or [False], dtype=bool)
    into_quantized = names[runs.dest] & (runs.count > 1)
    if into_quantized.any():  # stage runs are plain: take strided runs into quantized tensors row by row
        runs = Runs.concat([runs.take(np.flatnonzero(~into_quantized)), runs.expand(into_quantized)])
    dests: list[TensorEntry] = []
    remap = np.full(len(program.dests), -1, dtype=np.int64)
    staging, stage_of = [], {}
    for d, spec in enumerate(program.dests):
        if spec.name not in quantized:
            remap[d] = len(dests)
            dests.append(spec)
            continue
        weight, scale = quantized[spec.name].weight, quantized[spec.name].scale
        _, nbr, nbc = block_grid(spec.shape)
        stage_of[d] = len(staging)
        staging.append((spec.name, spec.shape, spec.ranks, len(dests), len(dests) + 1))
        dests.append(TensorEntry(weight, spec.shape, "float8_e4m3fn", ranks=spec.ranks))
        dests.append(TensorEntry(scale, (*spec.shape[:-2], nbr, nbc), "float32", ranks=spec.ranks))
    keep = remap[runs.dest] >= 0
    kept = runs.take(np.flatnonzero(keep))
    order = np.lexsort((runs.dst_off, runs.dest))
    staged = runs.take(order[~keep[order]])  # runs into quantized tensors, by (destination, dst_off)
    stage_index = np.full(len(program.dests), -1, dtype=np.int64)
    for d, stage in stage_of.items():
        stage_index[d] = stage
    holders = np.array([len(ranks) for _, _, ranks, _, _ in staging], dtype=np.int64)
    stage_cols, span_cols = _place(BlockGrids.of([shape for _, shape, _, _, _ in staging]), stage_index[staged.dest], staged, holders)
    placement = QuantPlacement(tuple(staging), stage_cols, span_cols)
    new_runs = dataclasses.replace(kept, dest=remap[kept.dest])
    # Constants into quantized tensors are their zero padding, which the zero-filled staging holds already.
    constants = program.constants.take(np.flatnonzero(remap[program.constants.dest] >= 0))
    constants = dataclasses.replace(constants, dest=remap[constants.dest])
    return dataclasses.replace(program, dests=tuple(dests), runs=new_runs, constants=constants,
                               quant_placement=placement)


def _place(grids: BlockGrids, stage: np.ndarray, runs, holders: np.ndarray) -> tuple[dict, dict]:
    """Stage runs and block spans for `runs` (into staging tensors `stage`, ordered by (stage, dst_off)).

    `holders[s]`: inference ranks holding staging tensor s. A block several trainer ranks write goes
    to the gather side when at least two inference ranks hold it (bf16 crosses the network once,
    fp8 goes to each holder), else to the receiver side (bf16 to its one holder, no extra hop).
    """
    item, lo, hi = block_intervals(grids, stage, runs.dst_off, runs.length)
    rank = runs.src_rank[item]
    seg = _segments(grids, lo, hi, rank, np.zeros(0, dtype=np.int64))
    cuts = _band_cuts(grids, seg, holders)
    if len(cuts):  # cut again so that every segment that may be gathered lies in one block row
        seg = _segments(grids, lo, hi, rank, cuts)
    gathered = seg.multi & (holders[seg.stage] >= 2)
    gatherer, pair_item, pair_seg = _gatherers(grids, seg, gathered, item, rank, holders)
    side = np.where(seg.owner >= 0, Side.SENDER, np.where(gathered, Side.GATHER, Side.RECEIVER))
    quant_rank = np.where(seg.owner >= 0, seg.owner, gatherer)
    # Spans: runs of segments with one side and quantizing rank within one tensor.
    new = np.ones(len(side), dtype=bool)
    new[1:] = (side[1:] != side[:-1]) | (quant_rank[1:] != quant_rank[:-1]) | (seg.stage[1:] != seg.stage[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(side)).astype(np.int64) if len(starts) else starts
    span_stage = seg.stage[starts]
    span_cols = dict(zip(SPAN_COLUMNS, (
        span_stage, seg.bounds[starts] - grids.base[span_stage], seg.bounds[ends] - seg.bounds[starts],
        side[starts], quant_rank[starts],
    )))
    # A run is listed once per (side, quantizing rank) among the segments it touches.
    on_side = {s: item[seg.touches(side == s)] for s in (Side.SENDER, Side.RECEIVER)}
    run_item = np.concatenate(list(on_side.values()))
    run_side = np.concatenate([np.full(len(items), s) for s, items in on_side.items()])
    rows = np.unique(np.stack([
        np.concatenate([run_item, pair_item]),
        np.concatenate([run_side, np.full(len(pair_item), Side.GATHER)]),
        np.concatenate([np.where(run_side == Side.SENDER, runs.src_rank[run_item], -1), gatherer[pair_seg]]),
    ], axis=1).reshape(-1, 3), axis=0)  # sorted by (run, side, quantizing rank)
    row_run, row_side, row_quant = rows[:, 0], rows[:, 1], rows[:, 2]
    stage_cols = dict(zip(STAGE_COLUMNS, (
        row_side, runs.src_rank[row_run], row_quant, runs.src[row_run], runs.src_off[row_run], stage[row_run],
        runs.dst_off[row_run], runs.length[row_run], runs.wire[row_run],
    )))
    return StageRuns.from_columns(stage_cols), BlockSpans.from_columns(span_cols)


@dataclasses.dataclass(frozen=True)
class _Segments:
    """Elementary block-id segments [bounds[i], bounds[i + 1]), each inside one tensor, with the ranks writing them.

    `first`/`last` give, per block interval, the segments it covers: [first, last).
    """

    bounds: np.ndarray
    stage: np.ndarray
    owner: np.ndarray  # the one trainer rank writing the segment, or -1
    multi: np.ndarray  # written by several trainer ranks
    first: np.ndarray
    last: np.ndarray

    def touches(self, mask: np.ndarray) -> np.ndarray:
        """Per interval: does it cover a segment where `mask` holds?"""
        before = np.concatenate([[0], np.cumsum(mask)])
        return before[self.last] - before[self.first] > 0


def _segments(grids: BlockGrids, lo, hi, rank, cuts) -> _Segments:
    """Cut the block ids at every interval end, tensor start and extra cut; find each segment's writers."""
    bounds = np.unique(np.concatenate([lo, hi, grids.base, cuts]))
    first, last = np.searchsorted(bounds, lo), np.searchsorted(bounds, hi)
    n = len(bounds)

    def covering_sum(weights):
        """Per segment: the sum of `weights` over the intervals covering it (difference array, then cumsum)."""
        starts = np.bincount(first, weights=weights, minlength=n) - np.bincount(last, weights=weights, minlength=n)
        return np.rint(np.cumsum(starts)[:-1]).astype(np.int64)

    count, total, squares = covering_sum(None), covering_sum(rank), covering_sum(rank * rank)
    # All covering ranks are equal iff count * sum(r^2) == sum(r)^2; untouched blocks (count 0) have no writer.
    single = (count > 0) & (count * squares == total * total)
    owner = np.where(single, total // np.maximum(count, 1), -1)
    seg_stage = np.searchsorted(grids.base, bounds[:-1], side="right") - 1
    return _Segments(bounds, seg_stage, owner, (count > 0) & ~single, first, last)


def _band(grids: BlockGrids, block: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """Block row (band) of each block id within its tensor."""
    return (block - grids.base[stage]) // grids.nbc[stage]


def _band_cuts(grids: BlockGrids, seg: _Segments, holders: np.ndarray) -> np.ndarray:
    """Block ids starting every block row inside a segment that may be gathered, so each is cut per block row."""
    candidate = np.flatnonzero(seg.multi & (holders[seg.stage] >= 2))
    stage = seg.stage[candidate]
    first = _band(grids, seg.bounds[candidate], stage) + 1
    last = _band(grids, seg.bounds[candidate + 1] - 1, stage)
    n = np.maximum(last - first + 1, 0)
    band = np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    stage = np.repeat(stage, n)
    return grids.base[stage] + band * grids.nbc[stage]


def _gatherers(grids: BlockGrids, seg: _Segments, gathered: np.ndarray, item, rank, holders: np.ndarray):
    """The trainer rank gathering each gathered segment: per block row, the least loaded of its writers so far.

    Returns (gatherer per segment, -1 elsewhere; and the (interval item, segment) pairs that write gathered segments).
    """
    touching = np.flatnonzero(seg.touches(gathered))
    n = seg.last[touching] - seg.first[touching]
    interval = np.repeat(touching, n)
    pair_seg = np.repeat(seg.first[touching], n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    keep = gathered[pair_seg]
    interval, pair_seg = interval[keep], pair_seg[keep]
    # One global id per block row, shared by the segments of that row.
    band_base = np.concatenate([[0], np.cumsum((grids.base[1:] - grids.base[:-1]) // np.maximum(grids.nbc, 1))])
    stage = seg.stage[pair_seg]
    row = band_base[stage] + _band(grids, seg.bounds[pair_seg], stage)
    writers = np.unique(np.stack([row, rank[interval]], axis=1).reshape(-1, 2), axis=0)
    rows, start, count = np.unique(writers[:, 0], return_index=True, return_counts=True)
    # What gathering a block row costs its gatherer: serving its fp8 bytes to every holder.
    row_stage = np.searchsorted(band_base, rows, side="right") - 1
    band = rows - band_base[row_stage]
    height = np.minimum(BLOCK, grids.rows[row_stage] - band % grids.nbr[row_stage] * BLOCK)
    pick = _least_loaded(writers[:, 1], start, count, height * grids.cols[row_stage] * holders[row_stage])
    gatherer = np.full(len(gathered), -1, dtype=np.int64)
    gatherer[pair_seg] = pick[np.searchsorted(rows, row)]
    return gatherer, item[interval], pair_seg


def _least_loaded(ranks: np.ndarray, start: np.ndarray, count: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """Greedy, in order: each item goes to the least loaded of its candidates ranks[start:start + count] (ties: lowest rank)."""
    load = np.zeros(int(ranks.max(initial=-1)) + 1, dtype=np.int64).tolist()
    candidates = ranks.tolist()
    pick = []
    for s, k, c in zip(start.tolist(), count.tolist(), cost.tolist()):
        best = min(candidates[s : s + k], key=load.__getitem__)
        load[best] += c
        pick.append(best)
    return np.array(pick, dtype=np.int64)
