"""verify: check plan invariants (bounds, dtypes, every destination byte written exactly once, by a run or a constant)."""

from __future__ import annotations

import numpy as np

from weightplan.runtime.casts import is_elementwise
from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.plan import invariants
from ..ir import Coverage, Program, Runs, itemsize
from .run_extents import unweave


class PlanInvariantError(WeightplanError):
    """A pass produced runs that break an invariant; the message names the tensor and offset."""


def verify(program: Program, *, require_full_coverage: bool = True) -> Coverage:
    """Raise PlanInvariantError on any violated invariant; return the destination coverage."""
    runs = program.runs
    if runs is None:
        raise PlanInvariantError("verify needs lowered runs; run lower_runs first")
    _check_strides(program, runs)
    _check_bounds(program, runs)
    _check_dtypes(program, runs)
    coverage = _coverage(program, runs)
    if require_full_coverage and coverage.uncovered:
        raise PlanInvariantError(uncovered_message(coverage, coverage.uncovered))
    return coverage


def uncovered_message(coverage: Coverage, names) -> str:
    """One line naming the tensors with unwritten bytes, the first gap, and the last write the tracer saw there."""
    return (f"{len(names)} destination tensors are not fully written by the plan ({', '.join(names[:5])}); "
            f"{coverage.first_gap}. No run and no traced constant writes those bytes: a write the tracer does not "
            "record (compiler/frontend/lazy_weight.py) or bytes vLLM's loaders leave unset")


def _check_strides(program: Program, runs: Runs) -> None:
    """Plain runs have count 1 and zero strides; a strided run's destination rows are disjoint and
    its rows are not one contiguous stretch on both sides (that is a plain run)."""
    if len(runs) == 0:
        return
    # the plan file's stride rules (runtime/plan/invariants.py), plus the compiler's own: no strided run that is
    # one contiguous stretch on both sides
    stretch = np.flatnonzero((runs.count > 1) & (runs.src_stride == runs.length) & (runs.dst_stride == runs.length))
    bad = np.union1d(invariants.malformed_strides(runs), stretch)
    if len(bad):
        i = bad[0]
        raise PlanInvariantError(
            f"malformed strided run into {program.dests[runs.dest[i]].name}: count {runs.count[i]}, length "
            f"{runs.length[i]}, strides {runs.src_stride[i]}/{runs.dst_stride[i]}"
        )


def _check_bounds(program: Program, runs: Runs) -> None:
    if len(runs) == 0:
        return
    if (runs.length <= 0).any():
        raise PlanInvariantError("a run has non-positive length")
    shard_numel = program.shard_numel  # [trainer rank, source] once split by shards
    if shard_numel is not None:
        src_limit = shard_numel[runs.src_rank, runs.src]
    else:
        src_limit = np.array([s.numel for s in program.sources], dtype=np.int64)[runs.src]
    dst_limit = np.array([d.numel for d in program.dests], dtype=np.int64)[runs.dest]
    c = program.constants
    if len(c):
        c_limit = np.array([d.numel for d in program.dests], dtype=np.int64)[c.dest]
        bad = np.flatnonzero((c.length <= 0) | (c.dst_off < 0) | (c.dst_off + c.length > c_limit))
        if len(bad):
            i = bad[0]
            spec = program.dests[c.dest[i]]
            raise PlanInvariantError(f"constant out of bounds or empty: {spec.name} {spec.shape} elements "
                                     f"[{c.dst_off[i]}, {c.dst_off[i] + c.length[i]})")
    side, i = invariants.first_out_of_bounds(runs, src_limit, dst_limit)  # the plan file's bounds rule
    if side:
        spec, off, end = ((program.sources[runs.src[i]], runs.src_off[i], runs.src_end()[i]) if side == "source"
                          else (program.dests[runs.dest[i]], runs.dst_off[i], runs.dst_end()[i]))
        raise PlanInvariantError(f"{side} run out of bounds: {spec.name} {spec.shape} elements [{off}, {end})")


def _check_dtypes(program: Program, runs: Runs) -> None:
    pairs = set(zip(runs.src.tolist(), runs.dest.tolist(), runs.wire.tolist()))
    for src, dest, wire in pairs:
        chain = program.cast_chains[wire]
        s, d = program.sources[src], program.dests[dest]
        if chain[0] != s.dtype or chain[-1] != d.dtype:
            raise PlanInvariantError(f"cast chain {chain} does not lead from {s.name} ({s.dtype}) to {d.name} ({d.dtype})")
        for step in chain:
            if not is_elementwise(step):
                itemsize(step)


def _coverage(program: Program, runs: Runs) -> Coverage:
    c = program.constants
    n = len(c)
    zero = np.zeros(n, dtype=np.int64)
    # Constants are runs from source -1; strided runs with other rows in their gaps: row by row; the rest by extent.
    runs = unweave(Runs.concat([runs, Runs.plain(zero - 1, zero, c.dest, c.dst_off, c.length, zero, zero)]), ("dest",))
    constant = runs.src == -1
    order = np.lexsort((runs.dst_off, runs.dest))
    r, constant = runs.take(order), constant[order]
    same = r.dest[1:] == r.dest[:-1]
    overlap = np.flatnonzero(same & (r.dst_end()[:-1] > r.dst_off[1:]))
    if len(overlap):
        i = overlap[0] + 1
        spec = program.dests[r.dest[i]]
        kinds = " and ".join(sorted({"a constant" if k else "a run" for k in constant[i - 1 : i + 1]}, reverse=True))
        raise PlanInvariantError(
            f"destination bytes written twice: {spec.name} element {r.dst_off[i]} "
            f"(inference ranks {list(spec.ranks)}), by {kinds}"
        )
    sizes = np.array([itemsize(d.dtype) for d in program.dests], dtype=np.int64)
    holders = np.array([len(d.ranks) for d in program.dests], dtype=np.int64)
    written = np.zeros(len(program.dests), dtype=np.int64)
    np.add.at(written, r.dest, r.length * r.count)
    numel = np.array([d.numel for d in program.dests], dtype=np.int64)
    missing = np.flatnonzero(written < numel)
    uncovered = tuple(program.dests[i].name for i in missing)
    constant_bytes = int((c.length * sizes[c.dest] * holders[c.dest]).sum()) if n else 0
    first_gap = _first_gap(program, r, int(missing[0])) if len(missing) else ""
    return Coverage(int((numel * sizes * holders).sum()), int((written * sizes * holders).sum()), uncovered, first_gap,
                    constant_bytes)


def _first_gap(program: Program, r: Runs, d: int) -> str:
    """The first byte range of destination `d` that the sorted, disjoint rows `r` leave unwritten, and its last traced write."""
    spec = program.dests[d]
    rows = r.expand(r.dest == d)  # strided runs row by row: their gaps may be the missing bytes
    order = np.argsort(rows.dst_off, kind="stable")
    starts = np.concatenate([rows.dst_off[order], [spec.numel]])
    ends = np.concatenate([[0], rows.dst_end()[order]])
    k = int(np.flatnonzero(ends < starts)[0])  # present: the rows cover fewer elements than the tensor has
    size = itemsize(spec.dtype)
    last = program.last_writes.get(spec.name, "none recorded")
    return (f"first gap: {spec.name} {list(spec.shape)} {spec.dtype} (inference ranks {list(spec.ranks)}) bytes "
            f"[{ends[k] * size}, {starts[k] * size}) of {spec.numel * size}; the last write the tracer saw into it: {last}")
