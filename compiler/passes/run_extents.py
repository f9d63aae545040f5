"""run_extents: find strided runs whose destination extent overlaps another run's, so rows may interleave."""

from __future__ import annotations

import numpy as np

from ..ir import Runs


def interleaved(runs: Runs, keys: tuple[str, ...]) -> np.ndarray:
    """Mask of runs whose destination extent [dst_off, dst_end) overlaps another run's with equal `keys`.

    Plain runs never overlap each other in a valid plan, so this finds strided runs whose gaps
    hold other runs' rows (or plans that write a byte twice). Rows of such runs can meet rows of
    other runs anywhere, so passes look at them row by row; any other strided run touches other
    runs at most at its first row's start and its last row's end.
    """
    n = len(runs)
    marked = np.zeros(n, dtype=bool)
    if n < 2 or not (runs.count > 1).any():
        return marked
    order = np.lexsort((runs.dst_off,) + tuple(getattr(runs, k) for k in reversed(keys)))
    cols = [getattr(runs, k)[order] for k in keys]
    starts_group = np.zeros(n, dtype=bool)
    starts_group[0] = True
    for col in cols:
        starts_group[1:] |= col[1:] != col[:-1]
    group = np.cumsum(starts_group) - 1
    start, end = runs.dst_off[order], runs.dst_end()[order]
    span = int(end.max()) + 1
    key = group * span + end  # groups ascend, so a running max never leaks from one group into the next
    best = np.maximum.accumulate(key)
    holder = np.maximum.accumulate(np.where(key == best, np.arange(n), 0))
    overlap = np.flatnonzero(~starts_group[1:] & (start[1:] < best[:-1] - group[1:] * span)) + 1
    marked[order[overlap]] = True
    marked[order[holder[overlap - 1]]] = True
    return marked


def unweave(runs: Runs, keys: tuple[str, ...]) -> Runs:
    """`runs` with every strided run that interleaves with another (equal `keys`) taken row by row."""
    mixed = interleaved(runs, keys) & (runs.count > 1)
    if not mixed.any():
        return runs
    return Runs.concat([runs.take(np.flatnonzero(~mixed)), runs.expand(mixed)])
