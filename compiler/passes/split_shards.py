"""split_shards: cut runs at trainer shard boundaries and address each piece in its rank's shard."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...runtime.shards import TrainerLayout, box_segments
from ..ir import Program, Runs, itemsize


def split_shards(program: Program) -> Program:
    """Give every run one serving trainer rank and a shard-local source offset.

    `meta["trainer_layout"]` (a ShardLayout, or a TrainerLayout shorthand; default one rank) says
    which box of each source every rank holds. Where several ranks hold the same box (HSDP
    replicas, Replicate() placements), each piece goes to the holder that has served the fewest
    bytes so far (bytes counted once per inference rank that reads them, pieces with one holder
    counted first, the others visited largest first), so the choice is deterministic and balanced.
    """
    layout = (program.meta.get("trainer_layout") or TrainerLayout()).bind(program.sources)
    runs = program.runs
    class_numel = np.array([[0 if b is None else int(np.prod([hi - lo for lo, hi in b])) for b in boxes]
                            for boxes in layout.classes], dtype=np.int64).reshape(len(layout.classes), layout.ranks)
    shard_numel = np.ascontiguousarray(class_numel[list(layout.of)].T).reshape(layout.ranks, len(program.sources))
    if layout.ranks == 1:  # one trainer rank holds every tensor whole: global offsets are local
        cut = dataclasses.replace(runs, src_rank=np.zeros(len(runs), dtype=np.int64))
        return dataclasses.replace(program, runs=cut, meta=dict(program.meta, shard_numel=shard_numel))
    holders = np.array([len(d.ranks) for d in program.dests], dtype=np.int64)
    sizes = np.array([itemsize(c[-1]) for c in program.cast_chains] or [0], dtype=np.int64)
    groups: list[np.ndarray] = []  # the ranks holding each distinct box, ascending
    segments: dict[int, tuple] = {}
    pieces = []
    by_src = runs.take(np.argsort(runs.src, kind="stable"))
    bounds = np.searchsorted(by_src.src, np.arange(len(program.sources) + 1))
    for src in np.flatnonzero(np.diff(bounds)):
        spec = program.sources[src]
        cls = layout.of[src]
        if cls not in segments:
            segments[cls] = _segments(layout.classes[cls], spec.shape, groups)
        mine = by_src.take(np.arange(bounds[src], bounds[src + 1]))
        pieces.append(_cut(mine, *segments[cls]))
    cut = Runs.concat(pieces)
    group = cut.src_rank  # _cut leaves the holder group in src_rank
    weight = cut.length * sizes[cut.wire] * holders[cut.dest]
    count = np.array([len(g) for g in groups], dtype=np.int64)
    first = np.array([g[0] for g in groups], dtype=np.int64)
    chosen = first[group]
    single = count[group] == 1
    served = np.bincount(chosen[single], weights=weight[single], minlength=layout.ranks).astype(np.int64)
    shared = np.flatnonzero(~single)
    for i in shared[np.argsort(-weight[shared], kind="stable")]:
        options = groups[group[i]]
        choice = options[np.argmin(served[options])]
        served[choice] += weight[i]
        chosen[i] = choice
    cut = dataclasses.replace(cut, src_rank=chosen)
    return dataclasses.replace(program, runs=cut, meta=dict(program.meta, shard_numel=shard_numel))


def _segments(boxes, shape, groups: list[np.ndarray]):
    """The distinct non-empty boxes of one tensor as flat segments sorted by global start, each
    tagged with the index of its holder group (appended to `groups`)."""
    holders: dict[tuple, list[int]] = {}
    for rank, box in enumerate(boxes):
        if box is not None and all(hi > lo for lo, hi in box):
            holders.setdefault(box, []).append(rank)
    parts = []
    for box, ranks in holders.items():
        start, length, local = box_segments(shape, box)
        parts.append((start, length, local, np.full(len(start), len(groups), dtype=np.int64)))
        groups.append(np.array(ranks, dtype=np.int64))
    start, length, local, group = (np.concatenate(p) for p in zip(*parts))
    order = np.argsort(start, kind="stable")
    return start[order], length[order], local[order], group[order]


def _cut(runs: Runs, seg_start, seg_len, seg_local, seg_rank) -> Runs:
    """Split runs (global source offsets) at segment ends; map each piece to (rank, local offset)."""
    out = []
    src_off, dst_off, remaining = runs.src_off.copy(), runs.dst_off.copy(), runs.length.copy()
    alive = np.arange(len(runs))
    while len(alive):
        seg = np.searchsorted(seg_start, src_off, side="right") - 1
        if (seg < 0).any() or (src_off >= seg_start[seg] + seg_len[seg]).any():
            raise AssertionError("a source byte is held by no trainer rank")
        take = np.minimum(remaining, seg_start[seg] + seg_len[seg] - src_off)
        out.append(dataclasses.replace(
            runs.take(alive),
            src_off=seg_local[seg] + (src_off - seg_start[seg]),
            dst_off=dst_off.copy(),
            length=take,
            src_rank=seg_rank[seg],
        ))
        src_off, dst_off, remaining = src_off + take, dst_off + take, remaining - take
        left = remaining > 0
        alive, src_off, dst_off, remaining = alive[left], src_off[left], dst_off[left], remaining[left]
    return Runs.concat(out)
