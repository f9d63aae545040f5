"""coalesce: merge runs that continue each other contiguously on both sides, across assignments."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Program, Runs
from .run_extents import unweave

STREAM = ("src_rank", "dest", "src", "wire")


def coalesce(program: Program) -> Program:
    """Reach the fewest rows: plain runs that continue each other merge into one, and strided runs
    continuing each other's progression merge into one run of more rows.

    Before that, strided runs whose rows interleave with other runs of their stream are taken row
    by row, and a strided run's first (last) row is peeled off when another run ends where it
    starts (starts where it ends) on both sides, so those rows can merge too.
    """
    runs = program.runs
    if runs is None or len(runs) == 0:
        return program
    runs = _peel(unweave(runs, STREAM))
    order = np.lexsort((runs.dst_off, runs.dest, runs.src_rank))
    r = runs.take(order)
    same_stream = np.ones(len(r) - 1, dtype=bool)
    for key in STREAM:
        column = getattr(r, key)
        same_stream &= column[1:] == column[:-1]
    plain = r.count == 1
    joins_plain = (
        plain[1:] & plain[:-1]
        & (r.dst_off[:-1] + r.length[:-1] == r.dst_off[1:])
        & (r.src_off[:-1] + r.length[:-1] == r.src_off[1:])
    )
    joins_progression = (
        ~plain[1:] & ~plain[:-1]
        & (r.length[1:] == r.length[:-1]) & (r.src_stride[1:] == r.src_stride[:-1]) & (r.dst_stride[1:] == r.dst_stride[:-1])
        & (r.src_off[:-1] + r.count[:-1] * r.src_stride[:-1] == r.src_off[1:])
        & (r.dst_off[:-1] + r.count[:-1] * r.dst_stride[:-1] == r.dst_off[1:])
    )
    starts = np.concatenate([[True], ~(same_stream & (joins_plain | joins_progression))])
    heads = np.flatnonzero(starts)
    merged = r.take(heads)
    head_plain = merged.count == 1
    lengths = np.where(head_plain, np.add.reduceat(r.length, heads), merged.length)
    counts = np.where(head_plain, 1, np.add.reduceat(r.count, heads))
    return dataclasses.replace(program, runs=dataclasses.replace(merged, length=lengths, count=counts))


def _peel(runs: Runs) -> Runs:
    """Split off a strided run's first or last row where another run of its stream continues it on both sides."""
    strided = np.flatnonzero(runs.count > 1)
    if not len(strided):
        return runs
    stream = np.stack([getattr(runs, k) for k in STREAM], axis=1)
    sid = _stream_ids(runs)
    near = np.flatnonzero(np.isin(sid, sid[strided]))
    src_end, dst_end = runs.src_end(), runs.dst_end()
    ends = {(*stream[i], src_end[i], dst_end[i]) for i in near.tolist()}
    starts = {(*stream[i], runs.src_off[i], runs.dst_off[i]) for i in near.tolist()}
    head = np.array([(*stream[i], runs.src_off[i], runs.dst_off[i]) in ends for i in strided.tolist()], dtype=bool)
    tail = np.array([(*stream[i], src_end[i], dst_end[i]) in starts for i in strided.tolist()], dtype=bool)
    if not (head.any() or tail.any()):
        return runs
    cut = strided[head | tail]
    first, last = head[head | tail], tail[head | tail]
    r = runs.take(cut)
    rows = Runs.concat([r.row(np.flatnonzero(first), np.zeros(first.sum(), dtype=np.int64)),
                        r.row(np.flatnonzero(last), r.count[last] - 1)])
    count = r.count - first - last
    rest = r.take(np.flatnonzero(count > 0))
    shift = first[count > 0].astype(np.int64)
    left = count[count > 0]
    rest = dataclasses.replace(
        rest, src_off=rest.src_off + shift * rest.src_stride, dst_off=rest.dst_off + shift * rest.dst_stride, count=left,
        src_stride=np.where(left > 1, rest.src_stride, 0), dst_stride=np.where(left > 1, rest.dst_stride, 0),
    )
    keep = np.ones(len(runs), dtype=bool)
    keep[cut] = False
    return Runs.concat([runs.take(np.flatnonzero(keep)), rows, rest])


def _stream_ids(runs: Runs) -> np.ndarray:
    """One integer per run naming its stream (mixed radix over the STREAM columns)."""
    sid = np.zeros(len(runs), dtype=np.int64)
    for key in STREAM:
        column = getattr(runs, key)
        radix = int(column.max()) + 1
        if int(sid.max()) >= (1 << 62) // radix:
            _, sid = np.unique(np.stack([sid, column], axis=1), axis=0, return_inverse=True)  # compact, then go on
            sid = sid.reshape(-1).astype(np.int64)
            continue
        sid = sid * radix + column
    return sid
