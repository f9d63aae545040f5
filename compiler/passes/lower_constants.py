"""lower_constants: resolve traced fills into constant runs: later fills win, and copies win over the fills before them."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Constants, Program


def lower_constants(program: Program) -> Program:
    """Turn Program.fills (one rank, runs lowered) into Constants: the elements whose last write is a constant.

    The tracer refuses a fill over elements a copy already wrote, so a copy overlapping a fill came
    after it and its elements are not constant.
    """
    if not program.fills:
        return program
    dest_index = program.dest_index()
    runs = program.runs
    by_dest: dict[str, list] = {}
    for fill in program.fills:
        by_dest.setdefault(fill.dest, []).append(fill)
    dest, off, length, values = [], [], [], []
    for name in sorted(by_dest, key=dest_index.__getitem__):
        d = dest_index[name]
        cast = _caster(program.dests[d].dtype)
        fills = by_dest[name]
        spans = [f.geometry.intervals() for f in fills]
        rows = runs.expand(runs.dest == d)
        bounds = np.unique(np.concatenate([x for s in spans for x in s] + [rows.dst_off, rows.dst_end()]))
        winner = np.full(max(len(bounds) - 1, 0), -1, dtype=np.int64)
        for k, (starts, ends) in enumerate(spans):  # fills in trace order: a later one overrides
            winner[_covered(bounds, starts, ends)] = k
        keep = np.flatnonzero((winner >= 0) & ~_covered(bounds, rows.dst_off, rows.dst_end()))
        seg_start, seg_end, seg_fill = bounds[keep], bounds[keep + 1], winner[keep]
        seg_value = [cast(fills[k].value) for k in seg_fill.tolist()]
        # Merge neighbouring segments holding the same value.
        first = [i for i in range(len(keep)) if i == 0 or seg_start[i] != seg_end[i - 1] or seg_value[i] != seg_value[i - 1]]
        stops = [seg_end[j - 1] for j in first[1:]] + ([seg_end[-1]] if len(keep) else [])
        for i, end in zip(first, stops):
            dest.append(d)
            off.append(int(seg_start[i]))
            length.append(int(end - seg_start[i]))
            values.append(seg_value[i])
    constants = Constants(np.array(dest, dtype=np.int64), np.array(off, dtype=np.int64), np.array(length, dtype=np.int64),
                          tuple(values))
    return dataclasses.replace(program, fills=(), constants=constants)


def _covered(bounds: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Which elementary segments [bounds[i], bounds[i+1]) lie inside the union of [starts, ends)."""
    delta = np.zeros(len(bounds), dtype=np.int64)
    np.add.at(delta, np.searchsorted(bounds, starts), 1)
    np.add.at(delta, np.searchsorted(bounds, ends), -1)
    return np.cumsum(delta)[:-1] > 0


def _caster(dtype: str):
    """The Python scalar type a constant of a `dtype` tensor is stored as (fill_(0) and fill_(0.0) write the same)."""
    if dtype == "bool":
        return bool
    return float if "float" in dtype else int
