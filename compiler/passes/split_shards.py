"""split_shards: cut runs at trainer shard boundaries and address each piece in its rank's shard."""

from __future__ import annotations

import dataclasses

import numpy as np

from weightplan.runtime.errors import LayoutError
from weightplan.runtime.layout.shards import TrainerLayout, box_segments
from ..ir import Program, Runs, SourceChoice, itemsize
from .source_flow import fill_quotas, min_max_quotas


def split_shards(program: Program) -> Program:
    """Give every run one serving trainer rank and a shard-local source offset.

    `program.trainer_layout` (a ShardLayout, or a TrainerLayout shorthand; default one rank) says
    which box of each source every rank holds. Where several ranks hold the same box (HSDP
    replicas, Replicate() placements), the bytes are split among the holders so that the busiest
    trainer rank serves as few bytes as possible (counted once per inference rank that reads
    them): `source_flow.min_max_quotas` finds that optimum exactly by max-flow, and each group's
    pieces, in source order, are cut at element (strided runs: row) boundaries into the holders'
    quotas. The greedy choice (each piece, largest first, to the holder that has served the fewest
    bytes so far) is kept unless the split is strictly better, so a plan never gets worse and
    plans without replicated bytes stay as they were. Both are deterministic; the figures of both
    go to `program.source_choice`.
    """
    layout = (program.trainer_layout or TrainerLayout()).bind(program.sources)
    runs = program.runs
    class_numel = np.array([[0 if b is None else int(np.prod([hi - lo for lo, hi in b])) for b in boxes]
                            for boxes in layout.classes], dtype=np.int64).reshape(len(layout.classes), layout.ranks)
    shard_numel = np.ascontiguousarray(class_numel[list(layout.of)].T).reshape(layout.ranks, len(program.sources))
    if layout.ranks == 1:  # one trainer rank holds every tensor whole: global offsets are local
        cut = dataclasses.replace(runs, src_rank=np.zeros(len(runs), dtype=np.int64))
        return dataclasses.replace(program, runs=cut, shard_numel=shard_numel)
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
    weight = _weight(cut, sizes, holders)
    count = np.array([len(g) for g in groups], dtype=np.int64)
    first = np.array([g[0] for g in groups], dtype=np.int64)
    chosen = first[group]
    single = count[group] == 1
    fixed = np.bincount(chosen[single], weights=weight[single], minlength=layout.ranks).astype(np.int64)
    served = fixed.copy()
    shared = np.flatnonzero(~single)
    for i in shared[np.argsort(-weight[shared], kind="stable")]:
        options = groups[group[i]]
        choice = options[np.argmin(served[options])]
        served[choice] += weight[i]
        chosen[i] = choice
    greedy = dataclasses.replace(cut, src_rank=chosen)
    result, loads, method = greedy, served, "greedy"
    if len(shared):
        split = _split_among_holders(greedy, shared, group, groups, weight, sizes[cut.wire] * holders[cut.dest], fixed)
        split_loads = np.bincount(split.src_rank, weights=_weight(split, sizes, holders), minlength=layout.ranks).astype(np.int64)
        if split_loads.max() < served.max():
            result, loads, method = split, split_loads, "flow"
    choice = SourceChoice(greedy_max=int(served.max()), greedy_mean=float(served.mean()), chosen_max=int(loads.max()),
                          chosen_mean=float(loads.mean()), shared_bytes=int(weight[shared].sum()), method=method)
    return dataclasses.replace(program, runs=result, shard_numel=shard_numel, source_choice=choice)


def _weight(runs: Runs, sizes: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """Bytes each run puts on its trainer rank's NIC: once per inference rank reading it."""
    return runs.count * runs.length * sizes[runs.wire] * holders[runs.dest]


def _split_among_holders(greedy: Runs, shared: np.ndarray, group: np.ndarray, groups: list[np.ndarray],
                         weight: np.ndarray, element_bytes: np.ndarray, fixed: np.ndarray) -> Runs:
    """The single-holder pieces as they are, then every shared piece (or its parts) given a holder
    by the max-flow quotas: per set of holders, pieces in (source, source offset) order, cut where
    a quota ends (plain runs at an element, strided runs at a row)."""
    # Boxes of different tensors held by the same ranks are one group for the flow.
    distinct = {tuple(g.tolist()): None for g in groups}
    index = {key: k for k, key in enumerate(distinct)}
    group = np.array([index[tuple(g.tolist())] for g in groups], dtype=np.int64)[group]
    groups = [np.array(key, dtype=np.int64) for key in distinct]
    totals = np.bincount(group[shared], weights=weight[shared], minlength=len(groups)).astype(np.int64)
    _, quota = min_max_quotas(fixed, groups, totals)
    cut = greedy  # the same pieces; only the shared ones' ranks are chosen again
    parts = [cut.take(np.setdiff1d(np.arange(len(cut)), shared))]
    for g in np.unique(group[shared]).tolist():
        mine = shared[group[shared] == g]
        mine = mine[np.lexsort((cut.dst_off[mine], cut.dest[mine], cut.src_off[mine], cut.src[mine]))]
        runs = cut.take(mine)
        strided = runs.count > 1
        unit = np.where(strided, runs.length, 1) * element_bytes[mine]  # bytes of one cuttable step
        piece, first, stop, share = fill_quotas(weight[mine], unit, quota[g, groups[g]])
        p = runs.take(piece)
        rows = stop - first
        step_src = np.where(strided[piece], p.src_stride, 1)
        step_dst = np.where(strided[piece], p.dst_stride, 1)
        parts.append(dataclasses.replace(
            p,
            src_off=p.src_off + first * step_src,
            dst_off=p.dst_off + first * step_dst,
            length=np.where(strided[piece], p.length, rows),
            count=np.where(strided[piece], rows, 1),
            src_stride=np.where(strided[piece] & (rows > 1), p.src_stride, 0),
            dst_stride=np.where(strided[piece] & (rows > 1), p.dst_stride, 0),
            src_rank=groups[g][share],
        ))
    return Runs.concat(parts)


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
    """Split runs (global source offsets) at segment ends; map each piece to (holder group, local offset).

    A strided run inside one segment keeps its rows together; one spanning several segments keeps,
    per segment, the rows lying wholly inside it as one strided piece, and its other rows are cut
    one by one like plain runs.
    """
    strided = runs.count > 1
    if not strided.any():
        return _cut_rows(runs, seg_start, seg_len, seg_local, seg_rank)
    many = runs.take(np.flatnonzero(strided))
    first = np.searchsorted(seg_start, many.src_off, side="right") - 1
    whole = (first >= 0) & (many.src_end() <= seg_start[first] + seg_len[first])
    inside = many.take(np.flatnonzero(whole))
    at = first[whole]
    inside = dataclasses.replace(inside, src_off=seg_local[at] + (inside.src_off - seg_start[at]), src_rank=seg_rank[at])
    pieces, loose = _cut_strided(many.take(np.flatnonzero(~whole)), seg_start, seg_len, seg_local, seg_rank)
    rows = _cut_rows(Runs.concat([runs.take(np.flatnonzero(~strided)), loose]), seg_start, seg_len, seg_local, seg_rank)
    return Runs.concat([rows, inside, pieces])


def _cut_strided(runs: Runs, seg_start, seg_len, seg_local, seg_rank) -> tuple[Runs, Runs]:
    """Strided runs spanning several segments: (one strided piece per segment for the rows wholly
    inside it, the other rows as plain runs)."""
    first = np.maximum(np.searchsorted(seg_start, runs.src_off, side="right") - 1, 0)
    last = np.searchsorted(seg_start, runs.src_end() - 1, side="right") - 1
    n_pairs = np.maximum(last - first + 1, 0)
    run = np.repeat(np.arange(len(runs)), n_pairs)
    seg = first[run] + np.arange(len(run)) - np.repeat(np.cumsum(n_pairs) - n_pairs, n_pairs)
    off, stride, length, count = runs.src_off[run], runs.src_stride[run], runs.length[run], runs.count[run]
    moving = stride > 0  # a zero stride reads one source row `count` times: it is in one segment or cut row by row
    step = np.where(moving, stride, 1)
    lo = np.maximum(-((off - seg_start[seg]) // step), 0)  # first row starting at or after the segment start
    hi = np.minimum((seg_start[seg] + seg_len[seg] - length - off) // step, count - 1)  # last row ending inside it
    keep = moving & (lo <= hi)
    run, seg, lo, hi = run[keep], seg[keep], lo[keep], hi[keep]
    picked = runs.take(run)
    n = hi - lo + 1
    several = n > 1
    pieces = dataclasses.replace(
        picked,
        src_off=seg_local[seg] + (picked.src_off + lo * picked.src_stride - seg_start[seg]),
        dst_off=picked.dst_off + lo * picked.dst_stride,
        count=n,
        src_stride=np.where(several, picked.src_stride, 0),
        dst_stride=np.where(several, picked.dst_stride, 0),
        src_rank=seg_rank[seg],
    )
    # Rows no piece took (those straddling a segment end, or in no segment) go row by row.
    begin = np.cumsum(runs.count) - runs.count
    marks = np.zeros(int(runs.count.sum()) + 1, dtype=np.int64)
    np.add.at(marks, begin[run] + lo, 1)
    np.add.at(marks, begin[run] + hi + 1, -1)
    row = np.flatnonzero(np.cumsum(marks[:-1]) == 0)
    owner = np.searchsorted(begin, row, side="right") - 1
    return pieces, runs.row(owner, row - begin[owner])


_UNHELD = ("a source byte is held by no trainer rank: the trainer layout's boxes do not cover every source tensor; "
           "check the --trainer-layout file (or the DTensor placements it was written from)")


def _cut_rows(runs: Runs, seg_start, seg_len, seg_local, seg_rank) -> Runs:
    """Split runs (global source offsets) at segment ends; map each piece to (rank, local offset).

    Pieces come out ordered by (piece index within its run, run), as successive cuts would give.
    """
    end = runs.src_off + runs.length
    first = np.searchsorted(seg_start, runs.src_off, side="right") - 1
    last = np.searchsorted(seg_start, end - 1, side="right") - 1
    if len(runs) and ((first < 0).any() or (last < first).any()):
        raise LayoutError(_UNHELD)
    count = last - first + 1
    offset = np.cumsum(count) - count  # where each run's pieces start
    run = np.repeat(np.arange(len(runs)), count)
    k = np.arange(len(run)) - offset[run]  # piece index within its run
    seg = first[run] + k
    lo = np.maximum(runs.src_off[run], seg_start[seg])
    hi = np.minimum(end[run], seg_start[seg] + seg_len[seg])
    length = hi - lo
    if len(runs) and ((length <= 0).any() or (np.add.reduceat(length, offset) != runs.length).any()):
        raise LayoutError(_UNHELD)
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
