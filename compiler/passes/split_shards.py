"""split_shards: cut runs at trainer shard boundaries and address each piece in its rank's shard."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...runtime.shards import TrainerLayout, box_segments, shard_box
from ..ir import Program, Runs, itemsize


def split_shards(program: Program) -> Program:
    """Give every run one serving trainer rank and a shard-local source offset.

    Where several ranks hold the same bytes (HSDP replicas), the piece goes to the holder that
    has served the fewest bytes so far (bytes counted once per inference rank that reads them),
    visiting pieces in a fixed order, so the choice is deterministic and balanced.
    """
    layout: TrainerLayout = program.meta.get("trainer_layout", TrainerLayout())  # default: one rank holds all
    runs = program.runs
    if layout.ranks == 1:  # one trainer rank holds every tensor whole: global offsets are local
        shard_numel = np.array([[spec.numel for spec in program.sources]], dtype=np.int64)
        cut = dataclasses.replace(runs, src_rank=np.zeros(len(runs), dtype=np.int64))
        return dataclasses.replace(program, runs=cut, meta=dict(program.meta, shard_numel=shard_numel))
    holders = np.array([len(d.ranks) for d in program.dests], dtype=np.int64)
    sizes = np.array([itemsize(c[-1]) for c in program.cast_chains] or [0], dtype=np.int64)
    served = np.zeros(layout.ranks, dtype=np.int64)
    pieces = []
    segments: dict[tuple, tuple] = {}  # (shape, sharding) -> _segments(...): layers repeat shapes
    by_src = runs.take(np.argsort(runs.src, kind="stable"))
    bounds = np.searchsorted(by_src.src, np.arange(len(program.sources) + 1))
    for src in np.flatnonzero(np.diff(bounds)):
        spec = program.sources[src]
        mine = by_src.take(np.arange(bounds[src], bounds[src + 1]))
        key = (spec.shape, spec.sharding)
        if key not in segments:
            segments[key] = _segments(layout, spec.shape, spec.sharding)
        pieces.append(_cut(mine, *segments[key]))
    cut = Runs.concat(pieces)
    # Pick one holder (replica) per piece, balancing bytes served.
    weight = cut.length * sizes[cut.wire] * holders[cut.dest]
    base = cut.src_rank.copy()
    if layout.replicas > 1:
        for i in np.argsort(-weight, kind="stable"):
            options = base[i] + layout.fsdp * np.arange(layout.replicas)
            choice = options[np.argmin(served[options])]
            served[choice] += weight[i]
            base[i] = choice
    cut = dataclasses.replace(cut, src_rank=base)
    numel_of: dict[tuple, np.ndarray] = {}
    shard_numel = np.zeros((layout.ranks, len(program.sources)), dtype=np.int64)
    for i, spec in enumerate(program.sources):
        key = (spec.shape, spec.sharding)
        if key not in numel_of:
            numel_of[key] = np.array([_box_numel(shard_box(layout, spec.shape, spec.sharding, rank), spec.shape)
                                      for rank in range(layout.ranks)], dtype=np.int64)
        shard_numel[:, i] = numel_of[key]
    meta = dict(program.meta, shard_numel=shard_numel)
    return dataclasses.replace(program, runs=cut, meta=meta)


def _box_numel(box, shape) -> int:
    return int(np.prod([b - a for a, b in box])) if box else (1 if not shape else 0)


def _segments(layout: TrainerLayout, shape, sharding):
    """All shard segments of one tensor within replica 0, sorted by global start."""
    parts = []
    for rank in range(layout.fsdp):
        box = shard_box(layout, shape, sharding, rank)
        start, length, local = box_segments(shape, box)
        parts.append((start, length, local, np.full(len(start), rank, dtype=np.int64)))
    start, length, local, rank = (np.concatenate(p) for p in zip(*parts))
    order = np.argsort(start, kind="stable")
    return start[order], length[order], local[order], rank[order]


def _cut(runs: Runs, seg_start, seg_len, seg_local, seg_rank) -> Runs:
    """Split runs (global source offsets) at segment ends; map each piece to (rank, local offset).

    Pieces come out ordered by (piece index within its run, run), as successive cuts would give.
    """
    end = runs.src_off + runs.length
    first = np.searchsorted(seg_start, runs.src_off, side="right") - 1
    last = np.searchsorted(seg_start, end - 1, side="right") - 1
    if len(runs) and ((first < 0).any() or (last < first).any()):
        raise AssertionError("a source byte is held by no trainer rank")
    count = last - first + 1
    offset = np.cumsum(count) - count  # where each run's pieces start
    run = np.repeat(np.arange(len(runs)), count)
    k = np.arange(len(run)) - offset[run]  # piece index within its run
    seg = first[run] + k
    lo = np.maximum(runs.src_off[run], seg_start[seg])
    hi = np.minimum(end[run], seg_start[seg] + seg_len[seg])
    length = hi - lo
    if len(runs) and ((length <= 0).any() or (np.add.reduceat(length, offset) != runs.length).any()):
        raise AssertionError("a source byte is held by no trainer rank")
    order = np.lexsort((run, k))
    run, seg, lo, length = run[order], seg[order], lo[order], length[order]
    pieces = runs.take(run)
    return dataclasses.replace(
        pieces,
        src_off=seg_local[seg] + (lo - seg_start[seg]),
        dst_off=pieces.dst_off + (lo - pieces.src_off),
        length=length,
        src_rank=seg_rank[seg],
    )
