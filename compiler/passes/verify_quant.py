"""verify_quant: every block quantized exactly once on one side; sender blocks read only their own rank's shard;
gathered blocks are fed to their gathering rank."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightplan.runtime.plan.schema import GATHER, RECEIVER, SENDER, Side
from .quant_blocks import BlockGrids, block_intervals
from .verify import PlanInvariantError

SIDE_NAMES = {side: side.name.lower() for side in Side}


@dataclass(frozen=True)
class QuantCoverage:
    blocks: int  # blocks over all staging tensors, once per inference rank holding them
    sender_blocks: int
    gathered_blocks: int

    @property
    def sender_fraction(self) -> float:
        return self.sender_blocks / self.blocks if self.blocks else 0.0

    @property
    def gathered_fraction(self) -> float:
        return self.gathered_blocks / self.blocks if self.blocks else 0.0


def verify_quant(shapes: list[tuple[int, ...]], holders: list[int], stage: dict, spans: dict) -> QuantCoverage:
    """Check the fp8 tables of a plan (staging shapes, inference ranks per staging tensor, stage runs, spans)."""
    grids = BlockGrids.of(shapes)
    span_stage = np.asarray(spans["stage"], dtype=np.int64)
    for table, name in ((span_stage, "block span"), (np.asarray(stage["stage"]), "stage run")):
        if len(table) and (table.min() < 0 or table.max() >= len(shapes)):
            raise PlanInvariantError(f"a {name} names staging tensor {int(table.max())}, but there are {len(shapes)}")
    numel = np.array([int(np.prod(shape)) for shape in shapes], dtype=np.int64)
    outside = (stage["stage_off"] < 0) | (stage["length"] <= 0) | (stage["stage_off"] + stage["length"] > numel[stage["stage"]])
    if outside.any():
        i = int(np.flatnonzero(outside)[0])
        raise PlanInvariantError(f"stage run {i} [{stage['stage_off'][i]}:+{stage['length'][i]}] is empty or outside "
                                 f"staging tensor {stage['stage'][i]} ({numel[stage['stage'][i]]} elements)")
    lo = grids.base[span_stage] + spans["first_block"]
    hi = lo + spans["n_blocks"]
    order = np.lexsort((hi, lo))
    lo, hi, side, owner, span_stage = lo[order], hi[order], spans["side"][order], spans["src_rank"][order], span_stage[order]
    _check_tiling(shapes, grids, lo, hi, span_stage)
    _check_stage_runs(grids, stage, lo, side, owner)
    per_holder = spans["n_blocks"] * np.asarray(holders, dtype=np.int64)[spans["stage"]] if len(shapes) else np.zeros(0, np.int64)
    blocks = int((grids.base[1:] - grids.base[:-1]) @ np.asarray(holders, dtype=np.int64)) if len(shapes) else 0
    return QuantCoverage(blocks, int(per_holder[spans["side"] == SENDER].sum()), int(per_holder[spans["side"] == GATHER].sum()))


def _check_tiling(shapes, grids: BlockGrids, lo, hi, span_stage) -> None:
    """The spans, sorted, must tile every tensor's blocks: no gap, no overlap, none empty or across tensors."""
    total = int(grids.base[-1])
    expected_lo = np.concatenate([[0], hi[:-1]])
    bad = (lo != expected_lo) | (hi <= lo) | (hi > grids.base[span_stage + 1])
    if len(lo) == 0 and total == 0:
        return
    if not bad.any() and len(hi) and hi[-1] == total:
        return
    # The first block not covered exactly once, for the message.
    first = int(np.flatnonzero(bad)[0]) if bad.any() else len(lo)
    block = int(min(lo[first], expected_lo[first])) if first < len(lo) else int(hi[-1]) if len(hi) else 0
    count = int(((lo <= block) & (hi > block)).sum())
    index = int(np.searchsorted(grids.base, block, side="right") - 1)
    if count == 1:  # an empty span or one reaching past its tensor
        start = int(lo[first] - grids.base[span_stage[first]])
        raise PlanInvariantError(f"staging tensor {int(span_stage[first])}: the block span [{start}:+{int(hi[first] - lo[first])}] "
                                 f"is empty or reaches past its {int(grids.base[span_stage[first] + 1] - grids.base[span_stage[first]])} blocks")
    raise PlanInvariantError(f"staging tensor {index} {tuple(shapes[index])}: block {block - int(grids.base[index])} is "
                             f"quantized {count} times, not once")


def _check_stage_runs(grids: BlockGrids, stage: dict, span_lo, side, owner) -> None:
    """Each stage run's blocks: sender ones belong to its rank, and it is listed on every (side, quantizing rank) its blocks use."""
    keys = np.stack([stage["stage"], stage["stage_off"], stage["length"], stage["src_rank"]], axis=1)
    if len(keys) == 0:
        return
    copies, copy_of = np.unique(keys, axis=0, return_inverse=True)
    copy_of = copy_of.reshape(-1)
    # Per distinct copy, the (side, quantizing rank) pairs it is listed for, as one sortable code.
    ranks = int(max(stage["quant_rank"].max(initial=0), owner.max(initial=0))) + 2

    def code(copy, sides, quant_rank):
        return (copy * 3 + sides) * ranks + quant_rank + 1

    listed = np.unique(code(copy_of, stage["side"], stage["quant_rank"]))
    item, lo, hi = block_intervals(grids, copies[:, 0], copies[:, 1], copies[:, 2])
    # Spans each interval touches (spans tile the blocks, sorted): [first, last).
    first = np.searchsorted(span_lo, lo, side="right") - 1
    last = np.searchsorted(span_lo, hi, side="left")
    pair = np.repeat(np.arange(len(item)), last - first)
    span = np.arange(len(pair)) - np.repeat(np.cumsum(last - first) - (last - first), last - first) + first[pair]
    rank = copies[item[pair], 3]

    def located(p: int):
        """The stage copy of (interval, span) pair p, and the first block they share (within its tensor)."""
        c = copies[item[pair[p]]]
        return c, max(int(span_lo[span[p]]), int(lo[pair[p]])) - int(grids.base[c[0]])

    stray = np.flatnonzero((side[span] == SENDER) & (owner[span] != rank))
    if len(stray):
        c, block = located(stray[0])
        raise PlanInvariantError(f"staging tensor {c[0]}: sender-side block {block} of trainer rank {owner[span[stray[0]]]} "
                                 f"is also written from trainer rank {c[3]}")
    wanted = code(item[pair], side[span], np.where(side[span] == RECEIVER, -1, owner[span]))
    missing = np.flatnonzero(~np.isin(wanted, listed))
    if len(missing):
        c, block = located(missing[0])
        where = SIDE_NAMES[int(side[span[missing[0]]])]
        by = f" by trainer rank {owner[span[missing[0]]]}" if side[span[missing[0]]] == GATHER else ""
        raise PlanInvariantError(f"staging tensor {c[0]}: block {block} is quantized on the {where} side{by} but "
                                 f"its stage run [{c[1]}:+{c[2]}] from trainer rank {c[3]} does not go there")
