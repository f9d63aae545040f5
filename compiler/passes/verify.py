"""verify: check plan invariants (bounds, dtypes, every destination byte written exactly once)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...runtime.errors import WeightplanError
from ..ir import Program, Runs, itemsize


class PlanInvariantError(WeightplanError):
    """A pass produced runs that break an invariant; the message names the tensor and offset."""


@dataclass(frozen=True)
class Coverage:
    dst_bytes: int
    written_once_bytes: int
    uncovered: tuple[str, ...]  # destination tensors with bytes nobody writes

    @property
    def fraction(self) -> float:
        return self.written_once_bytes / self.dst_bytes if self.dst_bytes else 1.0


def verify(program: Program, *, require_full_coverage: bool = True) -> Coverage:
    """Raise PlanInvariantError on any violated invariant; return the destination coverage."""
    runs = program.runs
    if runs is None:
        raise PlanInvariantError("verify needs lowered runs; run lower_runs first")
    _check_bounds(program, runs)
    _check_dtypes(program, runs)
    coverage = _coverage(program, runs)
    if require_full_coverage and coverage.uncovered:
        raise PlanInvariantError(
            f"{len(coverage.uncovered)} destination tensors are not fully written by the plan, e.g. "
            f"{', '.join(coverage.uncovered[:5])}; vLLM's loaders never wrote those bytes from the trainer's tensors"
        )
    return coverage


def _check_bounds(program: Program, runs: Runs) -> None:
    if len(runs) == 0:
        return
    if (runs.length <= 0).any():
        raise PlanInvariantError("a run has non-positive length")
    src_numel = np.array([s.numel for s in program.sources], dtype=np.int64)
    dst_numel = np.array([d.numel for d in program.dests], dtype=np.int64)
    for side, tensor, off, numel, table in (
        ("source", runs.src, runs.src_off, src_numel, program.sources),
        ("destination", runs.dest, runs.dst_off, dst_numel, program.dests),
    ):
        bad = np.flatnonzero((off < 0) | (off + runs.length > numel[tensor]))
        if len(bad):
            i = bad[0]
            spec = table[tensor[i]]
            raise PlanInvariantError(
                f"{side} run out of bounds: {spec.name} {spec.shape} elements [{off[i]}, {off[i] + runs.length[i]})"
            )


def _check_dtypes(program: Program, runs: Runs) -> None:
    pairs = set(zip(runs.src.tolist(), runs.dest.tolist(), runs.wire.tolist()))
    for src, dest, wire in pairs:
        chain = program.cast_chains[wire]
        s, d = program.sources[src], program.dests[dest]
        if chain[0] != s.dtype or chain[-1] != d.dtype:
            raise PlanInvariantError(f"cast chain {chain} does not lead from {s.name} ({s.dtype}) to {d.name} ({d.dtype})")
        for dtype in chain:
            itemsize(dtype)


def _coverage(program: Program, runs: Runs) -> Coverage:
    order = np.lexsort((runs.dst_off, runs.dest, runs.dst_rank))
    r = runs.take(order)
    same = (r.dest[1:] == r.dest[:-1]) & (r.dst_rank[1:] == r.dst_rank[:-1])
    overlap = np.flatnonzero(same & (r.dst_off[:-1] + r.length[:-1] > r.dst_off[1:]))
    if len(overlap):
        i = overlap[0] + 1
        spec = program.dests[r.dest[i]]
        raise PlanInvariantError(
            f"destination bytes written twice: {spec.name} element {r.dst_off[i]} (inference rank {r.dst_rank[i]})"
        )
    sizes = np.array([itemsize(d.dtype) for d in program.dests], dtype=np.int64)
    written = np.zeros(len(program.dests), dtype=np.int64)
    np.add.at(written, r.dest, r.length)
    numel = np.array([d.numel for d in program.dests], dtype=np.int64)
    ranks = max(1, int(program.meta.get("dst_ranks", 1)))
    uncovered = tuple(program.dests[i].name for i in np.flatnonzero(written < numel * ranks))
    return Coverage(int((numel * sizes).sum()) * ranks, int((written * sizes).sum()), uncovered)


def descriptors_lower_bound(runs: Runs) -> int:
    """Fewest descriptors possible: runs that no other run continues on both sides (a hash join)."""
    if len(runs) == 0:
        return 0
    key = (runs.src_rank, runs.dst_rank, runs.src, runs.dest, runs.wire)
    ends = set(zip(*(k.tolist() for k in key), (runs.src_off + runs.length).tolist(), (runs.dst_off + runs.length).tolist()))
    starts = zip(*(k.tolist() for k in key), runs.src_off.tolist(), runs.dst_off.tolist())
    return sum(1 for s in starts if s not in ends)
