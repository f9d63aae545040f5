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
    sid = _stream_ids(runs)
    near = np.flatnonzero(np.isin(sid, sid[strided]))
    starts = np.stack([sid, runs.src_off, runs.dst_off], axis=1)  # (stream, source, destination) where each run starts
    ends = np.stack([sid, runs.src_end(), runs.dst_end()], axis=1)  # ... and where it ends
    head = _rows_in(starts[strided], ends[near])
    tail = _rows_in(ends[strided], starts[near])
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


def _rows_in(rows: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Whether each row of `rows` is a row of `table` (both int64, the same number of columns)."""
    both = np.concatenate([table, rows])
    order = np.lexsort(both.T[::-1])  # np.unique(axis=0) sorts void records, about 20x slower
    ordered = both[order]
    distinct = np.concatenate([[True], (ordered[1:] != ordered[:-1]).any(axis=1)])
    ids = np.empty(len(both), dtype=np.int64)
    ids[order] = np.cumsum(distinct)
    return np.isin(ids[len(table):], ids[: len(table)])


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
