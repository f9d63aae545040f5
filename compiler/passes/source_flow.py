"""source_flow: split replicated bytes among their holders so the busiest trainer NIC serves the fewest bytes (max-flow)."""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np


def min_max_quotas(fixed: np.ndarray, groups: Sequence[np.ndarray], totals: np.ndarray) -> tuple[int, np.ndarray]:
    """The least bound T on every rank's bytes, and bytes per (group, rank) meeting it.

    `fixed[r]` are the bytes rank r serves anyway (pieces only it holds); `totals[g]` are the
    bytes held by every rank of `groups[g]`, divisible among them at any byte. Returns T and an
    integer matrix `quota[g, r]` (zero outside the group) with `quota.sum(1) == totals` and
    `fixed + quota.sum(0) <= T`.

    Why this formulation: pieces held by the same ranks are interchangeable once they may be
    split, so only the groups' totals matter and the network is tiny (source -> group, capacity
    its bytes; group -> each holder, unbounded; rank -> sink, capacity T - fixed). T is feasible
    iff the maximum flow carries every group's bytes, and feasibility is monotone in T, so a
    binary search over integer T finds the least feasible bound exactly; with integer capacities
    the maximum flow is integral (integral flow theorem), so the quotas are whole bytes. A
    min-cost flow would need a convex cost per rank to express "minimise the maximum"; the
    parametric search states it directly and needs about 40 small max-flows.
    """
    fixed = np.asarray(fixed, dtype=np.int64)
    totals = np.asarray(totals, dtype=np.int64)
    ranks = len(fixed)
    quota = np.zeros((len(groups), ranks), dtype=np.int64)
    if not len(groups) or not totals.sum():
        return int(fixed.max(initial=0)), quota
    involved = np.unique(np.concatenate([np.asarray(g) for g in groups]))
    # Lower bound: every rank serves its own bytes, and the involved ranks share at least the groups' bytes.
    lo = max(int(fixed.max()), -(-(int(fixed[involved].sum()) + int(totals.sum())) // len(involved)))
    hi = int(fixed.max()) + int(totals.sum())  # one rank serving everything shared is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if _carries(fixed, groups, totals, mid)[0]:
            hi = mid
        else:
            lo = mid + 1
    _, flow = _carries(fixed, groups, totals, lo)
    for g, members in enumerate(groups):
        for r in members.tolist():
            quota[g, r] = flow[("g", g)].get(("r", r), 0)
    return lo, quota


def _carries(fixed: np.ndarray, groups: Sequence[np.ndarray], totals: np.ndarray, bound: int) -> tuple[bool, dict]:
    """Whether every group's bytes fit under `bound` per rank, and the flow that shows it."""
    graph = nx.DiGraph()
    for g, members in enumerate(groups):
        graph.add_edge("s", ("g", g), capacity=int(totals[g]))
        for r in members.tolist():
            graph.add_edge(("g", g), ("r", r))  # no capacity attribute: unbounded
    for r in sorted({r for members in groups for r in members.tolist()}):
        graph.add_edge(("r", r), "t", capacity=bound - int(fixed[r]))
    value, flow = nx.maximum_flow(graph, "s", "t")
    return value == int(totals.sum()), flow


def fill_quotas(weight: np.ndarray, unit: np.ndarray, quota: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut a stream of pieces (bytes `weight`, divisible only at multiples of `unit`) into
    consecutive shares of `quota` bytes (one per rank, in order).

    Returns (piece, first, stop, share) per part as arrays: part k is units
    `[first[k], stop[k])` of piece `piece[k]`, served by share `share[k]`. A cut falls on the unit
    boundary nearest to the exact one, so each share differs from its quota by less than one unit
    per cut; parts come out in stream order.
    """
    ends = np.cumsum(weight)
    starts = ends - weight
    bounds = np.cumsum(quota)[:-1]
    at = np.minimum(np.searchsorted(ends, bounds, side="right"), len(weight) - 1)
    u = unit[at]
    aligned = starts[at] + np.clip(np.rint((bounds - starts[at]) / u), 0, weight[at] // u).astype(np.int64) * u
    inner = (aligned > starts[at]) & (aligned < ends[at])
    cut_piece, cut_at = at[inner], aligned[inner]
    # Every piece contributes its start; every inner cut starts one more part of its piece.
    piece = np.concatenate([np.arange(len(weight)), cut_piece])
    begin = np.concatenate([starts, cut_at])
    order = np.lexsort((begin, piece))
    piece, begin = piece[order], begin[order]
    end = np.append(begin[1:], 0)
    last = np.append(piece[1:] != piece[:-1], True)
    end[last] = ends[piece[last]]
    share = np.searchsorted(aligned, begin, side="right")
    keep = end > begin
    piece, begin, end, share = piece[keep], begin[keep], end[keep], share[keep]
    return piece, (begin - starts[piece]) // unit[piece], (end - starts[piece]) // unit[piece], share
