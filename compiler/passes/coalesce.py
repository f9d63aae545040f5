"""coalesce: merge runs that continue each other contiguously on both sides, across assignments."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Program, Runs


def coalesce(program: Program) -> Program:
    """Sort runs by (trainer rank, destination, offset) and merge each into its predecessor when it continues it."""
    runs = program.runs
    if runs is None or len(runs) == 0:
        return program
    order = np.lexsort((runs.dst_off, runs.dest, runs.src_rank))
    r = runs.take(order)
    same_stream = (
        (r.src_rank[1:] == r.src_rank[:-1])
        & (r.dest[1:] == r.dest[:-1])
        & (r.src[1:] == r.src[:-1])
        & (r.wire[1:] == r.wire[:-1])
    )
    continues = (
        same_stream
        & (r.dst_off[:-1] + r.length[:-1] == r.dst_off[1:])
        & (r.src_off[:-1] + r.length[:-1] == r.src_off[1:])
    )
    starts = np.concatenate([[True], ~continues])
    heads = np.flatnonzero(starts)
    merged = r.take(heads)
    lengths = np.add.reduceat(r.length, heads)
    return dataclasses.replace(program, runs=dataclasses.replace(merged, length=lengths))
