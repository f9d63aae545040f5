"""split_expert_slots: cut the runs into EPLB expert tensors so that each lies inside one physical slot (dim 0 row).

vLLM's expert load balancer (`--enable-eplb`) moves whole physical slots between ranks and keeps a table of which
logical expert each slot holds; a receiver maps a plan's slot through the engine's current table
(runtime/plan/header.py: EplbHeader). So no run may write bytes of two slots: coalesce merges the runs of neighbouring
experts into one, and this pass cuts them again at slot boundaries. Rows crossing a boundary are cut; a strided run
whose rows fall in several slots becomes one strided run per slot (and per cut pattern of its rows).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..ir import Program, Runs


def split_expert_slots(program: Program) -> Program:
    """`program` with every run into an EPLB expert destination cut so that it writes inside one slot of its dim 0."""
    runs = program.runs
    slot = slot_sizes(program)
    if runs is None or len(runs) == 0 or not slot.any():
        return program
    size = slot[runs.dest]
    crossing = np.flatnonzero(_crosses(runs, size))
    if not len(crossing):
        return program
    pieces = _split(runs.take(crossing), size[crossing])
    keep = np.ones(len(runs), dtype=bool)
    keep[crossing] = False
    # each cut run's pieces take its place: the table's order is otherwise unchanged
    origin = np.concatenate([np.flatnonzero(keep), crossing[pieces[1]]])
    table = Runs.concat([runs.take(np.flatnonzero(keep)), pieces[0]])
    order = np.argsort(origin, kind="stable")
    return dataclasses.replace(program, runs=table.take(order))


def slot_sizes(program: Program) -> np.ndarray:
    """Elements per physical slot of each destination (prod of its shape[1:]) that an EPLB plan lists as an expert
    tensor; 0 for the others (and for every destination of a plan without EPLB)."""
    origin = program.origin
    eplb = origin.inference.eplb if origin is not None else None
    sizes = np.zeros(len(program.dests) + 1, dtype=np.int64)  # one spare: indexing an empty table stays valid
    if eplb is None:
        return sizes[:-1]
    experts = set(eplb.tensors)
    for i, entry in enumerate(program.dests):
        if entry.name in experts and len(entry.shape) >= 1:
            sizes[i] = math.prod(entry.shape[1:])
    return sizes[:-1]


def misaligned_runs(program: Program) -> np.ndarray:
    """Indexes (ascending) of the runs into EPLB expert destinations that write bytes of more than one slot."""
    runs = program.runs
    if runs is None or len(runs) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(_crosses(runs, slot_sizes(program)[runs.dest]))


def _crosses(runs: Runs, size: np.ndarray) -> np.ndarray:
    """Whether each run (slot size `size`, 0: not an expert tensor) writes into more than one slot."""
    per = np.maximum(size, 1)
    return (size > 0) & (runs.dst_off // per != (runs.dst_end() - 1) // per)


def _split(runs: Runs, size: np.ndarray) -> tuple[Runs, np.ndarray]:
    """(the pieces of `runs`, each inside one slot, and the index in `runs` each piece came from), in run order."""
    run = np.repeat(np.arange(len(runs)), runs.count)
    index = np.arange(len(run)) - np.repeat(np.cumsum(runs.count) - runs.count, runs.count)  # row i of its run
    start = runs.dst_off[run] + index * runs.dst_stride[run]
    end = start + runs.length[run]
    per = size[run]
    first, last = start // per, (end - 1) // per
    n = last - first + 1  # slots each row writes into
    row = np.repeat(np.arange(len(run)), n)
    slot = first[row] + np.arange(len(row)) - np.repeat(np.cumsum(n) - n, n)
    lo = np.maximum(start[row], slot * per[row])
    hi = np.minimum(end[row], (slot + 1) * per[row])
    offset, length = lo - start[row], hi - lo  # where in its row each piece lies
    owner, i = run[row], index[row]
    # pieces of one run in one slot, cut alike, on consecutive rows: one strided run with the run's strides
    order = np.lexsort((i, length, offset, slot, owner))
    owner, slot, offset, length, i = owner[order], slot[order], offset[order], length[order], i[order]
    head = np.ones(len(order), dtype=bool)
    head[1:] = ((owner[1:] != owner[:-1]) | (slot[1:] != slot[:-1]) | (offset[1:] != offset[:-1])
                | (length[1:] != length[:-1]) | (i[1:] != i[:-1] + 1))
    heads = np.flatnonzero(head)
    count = np.diff(np.append(heads, len(order)))
    o, first_row, off = owner[heads], i[heads], offset[heads]
    strided = count > 1
    pieces = Runs(src=runs.src[o], src_off=runs.src_off[o] + first_row * runs.src_stride[o] + off, dest=runs.dest[o],
                  dst_off=runs.dst_off[o] + first_row * runs.dst_stride[o] + off, length=length[heads], wire=runs.wire[o],
                  src_rank=runs.src_rank[o], count=count, src_stride=np.where(strided, runs.src_stride[o], 0),
                  dst_stride=np.where(strided, runs.dst_stride[o], 0))
    return pieces, o
