"""The reader's coverage proof: every destination element written exactly once (runs, constants, fp8 blocks): a sort and a scan."""

from __future__ import annotations

import numpy as np

from ..errors import PlanFormatError
from .loaded import Plan
from .schema import DTYPE_SIZES

# Strided runs whose extents overlap others' (rows interleaving) are checked row by row; at most this many rows,
# plus 16 per stored run, so the proof allocates a bounded multiple of the file's own size.
INTERLEAVED_ROWS = 1 << 20


def check_coverage(plan: Plan, origin: str) -> None:
    """Refuse a plan leaving any destination element unwritten or writing one twice (PlanFormatError naming the tensor).

    A tensor vLLM quantizes (an fp8 staging entry's weight and scale) is written by its block spans, which must tile its
    blocks exactly once; no run or constant may write it. Every other tensor is written by runs and constants. Runs are
    taken by extent ([dst_off, dst_end)): if the extents of one tensor, sorted, are disjoint and their rows add up to
    its size, every element is written once (a strided run's rows are disjoint, dst_stride >= length). Only tensors
    whose extents overlap (strided runs with other rows in their gaps, or a double write) are checked row by row.
    Runs the reader already bounded (runtime/plan/invariants.py: check_runs, check_constants) come first.
    """
    table, dests = plan.table, plan.dests
    quantized = np.zeros(len(dests), dtype=bool)
    for entry in plan.staging:
        quantized[[entry.weight, entry.scale]] = True
    constants = np.array([[c.dest, c.dst_off, c.length] for c in plan.constants], dtype=np.int64).reshape(-1, 3)
    dest = np.concatenate([table["dest"], constants[:, 0]])
    start = np.concatenate([table["dst_off"], constants[:, 1]])
    end = np.concatenate([table.dst_end(), constants[:, 1] + constants[:, 2]])
    rows = np.concatenate([table["count"], np.ones(len(constants), dtype=np.int64)])
    length = np.concatenate([table["length"], constants[:, 2]])
    into_quantized = np.flatnonzero(quantized[dest])
    if len(into_quantized):
        entry = dests[dest[into_quantized[0]]]
        raise PlanFormatError(f"{origin}: destination {entry.name!r} is quantized after loading (fp8 staging), yet a run "
                              "or constant writes it: its bytes would be written twice")
    overlapping = _overlapping_dests(dest, start, end)
    if len(overlapping):
        strided = np.flatnonzero(np.isin(table["dest"], overlapping) & (table["count"] > 1))
        n_rows = int(table["count"][strided].sum())
        if n_rows > INTERLEAVED_ROWS + 16 * len(table):
            entry = dests[table["dest"][strided[0]]]
            raise PlanFormatError(f"{origin}: strided runs into {entry.name!r} and other tensors overlap over {n_rows} rows, "
                                  f"more than the reader checks ({INTERLEAVED_ROWS} + 16 per stored run)")
        expanded = table.expand(np.isin(table["dest"], overlapping) & (table["count"] > 1))
        keep = np.concatenate([table["count"] == 1, np.ones(len(constants), dtype=bool)]) | ~np.isin(dest, overlapping)
        dest = np.concatenate([dest[keep], expanded.dest])
        start = np.concatenate([start[keep], expanded.dst_off])
        end = np.concatenate([end[keep], expanded.dst_end()])
        rows = np.concatenate([rows[keep], expanded.count])
        length = np.concatenate([length[keep], expanded.length])
        twice = _overlapping_dests(dest, start, end, first=True)
        if len(twice):
            d, element = twice
            raise PlanFormatError(f"{origin}: destination {_named(dests[d])} has element {element} written twice")
    # Disjoint and in bounds, so each tensor's sum is at most its size: no overflow.
    written = np.zeros(len(dests), dtype=np.int64)
    np.add.at(written, dest, rows * length)
    numel = np.array([e.numel for e in dests], dtype=np.int64)
    short = np.flatnonzero((written < numel) & ~quantized)
    if len(short):
        d = int(short[0])
        missing = int(numel[d] - written[d]) * DTYPE_SIZES[dests[d].dtype]
        gap = _first_gap(start[dest == d], end[dest == d], int(numel[d]), DTYPE_SIZES[dests[d].dtype])
        raise PlanFormatError(f"{origin}: {len(short)} destination tensors are not fully written: {_named(dests[d])} has "
                              f"{missing} of its {int(numel[d]) * DTYPE_SIZES[dests[d].dtype]} bytes unwritten{gap}; "
                              "a receiver would leave them as they were (recompile the plan)")
    _check_block_tiling(plan, origin)


def _overlapping_dests(dest: np.ndarray, start: np.ndarray, end: np.ndarray, first: bool = False):
    """Destinations where some interval starts before the previous one (sorted by start) ends; with `first`, the first
    such (destination, element) or ()."""
    order = np.lexsort((start, dest))
    d, s, e = dest[order], start[order], end[order]
    clash = np.flatnonzero((d[1:] == d[:-1]) & (e[:-1] > s[1:])) + 1
    if first:
        return (int(d[clash[0]]), int(s[clash[0]])) if len(clash) else ()
    return np.unique(d[clash])


def _first_gap(start: np.ndarray, end: np.ndarray, numel: int, size: int) -> str:
    """", the first unwritten bytes [a, b)" of a tensor whose intervals (disjoint) leave some unwritten, when one is an
    extent gap (a strided run's own gaps are not seen here)."""
    order = np.argsort(start, kind="stable")
    starts = np.concatenate([start[order], [numel]])
    ends = np.concatenate([[0], end[order]])
    gaps = np.flatnonzero(ends < starts)
    if not len(gaps):
        return ""
    k = int(gaps[0])
    return f", first bytes [{int(ends[k]) * size}, {int(starts[k]) * size})"


def _check_block_tiling(plan: Plan, origin: str) -> None:
    """Each fp8 staging tensor's block spans, sorted, tile its blocks (one scale element each) exactly once."""
    spans, staging = plan.spans, plan.staging
    if not staging:
        return
    blocks = np.array([plan.dests[e.scale].numel for e in staging], dtype=np.int64)
    order = np.lexsort((spans["first_block"], spans["stage"]))
    stage, first, n = spans["stage"][order], spans["first_block"][order], spans["n_blocks"][order]
    new = np.concatenate([[True], stage[1:] != stage[:-1]]) if len(stage) else np.zeros(0, dtype=bool)
    expected = np.where(new, 0, np.concatenate([[0], first[:-1] + n[:-1]]))
    bad = np.flatnonzero(first != expected)
    if len(bad):
        i = int(bad[0])
        entry = staging[stage[i]]
        raise PlanFormatError(f"{origin}: fp8 tensor {entry.name!r}: block {min(int(first[i]), int(expected[i]))} is "
                              f"{'never quantized' if first[i] > expected[i] else 'quantized twice'}")
    covered = np.zeros(len(staging), dtype=np.int64)
    np.add.at(covered, stage, n)
    short = np.flatnonzero(covered != blocks)
    if len(short):
        entry = staging[int(short[0])]
        raise PlanFormatError(f"{origin}: fp8 tensor {entry.name!r}: block spans quantize {int(covered[short[0]])} of its "
                              f"{int(blocks[short[0]])} blocks")


def _named(entry) -> str:
    return f"{entry.name!r} {entry.dtype}{list(entry.shape)} (inference ranks {list(entry.ranks)})"
