"""Descriptor counts of a run table: how many READ descriptors its rows post, and the fewest any coalescing could."""

from __future__ import annotations

import numpy as np

from ..ir import Runs
from .run_extents import unweave


def descriptors_lower_bound(runs: Runs, dests=None) -> int:
    """Fewest descriptors possible: rows that no other row continues on both sides (a hash join).

    A strided run's rows never continue each other, and unless other runs lie in its gaps
    (those are joined row by row) only its first row can continue another run. With `dests`,
    each row counts once per inference rank holding its destination (every holder posts its own read).
    """
    if len(runs) == 0:
        return 0
    runs = unweave(runs, ("src_rank", "dest", "src", "wire"))
    key = (runs.src_rank, runs.src, runs.dest, runs.wire)
    last_src, last_dst = runs.src_end(), runs.dst_end()
    ends = set(zip(*(k.tolist() for k in key), last_src.tolist(), last_dst.tolist()))
    starts = zip(*(k.tolist() for k in key), runs.src_off.tolist(), runs.dst_off.tolist())
    continued = np.array([s in ends for s in starts], dtype=np.int64)
    heads = runs.count - continued
    if dests is None:
        return int(heads.sum())
    holders = np.array([len(d.ranks) for d in dests], dtype=np.int64)
    return int((holders[runs.dest] * heads).sum())


def descriptors_posted(runs: Runs, dests) -> int:
    """Descriptors the inference ranks post in all, unpacked: each row once per rank holding its destination."""
    holders = np.array([len(d.ranks) for d in dests] or [0], dtype=np.int64)
    return int((holders[runs.dest] * runs.count).sum()) if len(runs) else 0
