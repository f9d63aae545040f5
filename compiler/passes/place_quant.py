"""place_quant: quantize each 128x128 block on its trainer rank when that rank alone holds it, else on the receiver."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...runtime.plan_format import SPAN_COLUMNS, STAGE_COLUMNS
from ...runtime.quant import BLOCK, block_grid
from ..ir import Program, QuantPlacement, Runs, TensorSpec


def place_quant(program: Program) -> Program:
    """Split runs into quantized tensors off into stage runs and block spans; replace those dests by fp8 weight + scale.

    `program.meta["quant_tensors"]` maps a bf16 destination name to (fp8 weight name, scale name).
    A block whose written elements all come from one trainer rank is quantized by that rank
    (side 0) from stage runs that rank executes locally; any other block (elements from several
    ranks, or none: all padding) is quantized by every receiver holding the tensor (side 1) from
    bf16 it pulls. A run feeding blocks of both sides is listed once per side.
    """
    quantized = program.meta.get("quant_tensors", {})
    runs = program.runs
    names = np.array([spec.name in quantized for spec in program.dests] or [False], dtype=bool)
    into_quantized = names[runs.dest] & (runs.count > 1)
    if into_quantized.any():  # stage runs are plain: take strided runs into quantized tensors row by row
        runs = Runs.concat([runs.take(np.flatnonzero(~into_quantized)), runs.expand(into_quantized)])
    dests: list[TensorSpec] = []
    remap = np.full(len(program.dests), -1, dtype=np.int64)
    staging, stage_of = [], {}
    for d, spec in enumerate(program.dests):
        if spec.name not in quantized:
            remap[d] = len(dests)
            dests.append(spec)
            continue
        weight, scale = quantized[spec.name]
        _, nbr, nbc = block_grid(spec.shape)
        stage_of[d] = len(staging)
        staging.append((spec.name, spec.shape, spec.ranks, len(dests), len(dests) + 1))
        dests.append(TensorSpec(weight, spec.shape, "float8_e4m3fn", ranks=spec.ranks))
        dests.append(TensorSpec(scale, (*spec.shape[:-2], nbr, nbc), "float32", ranks=spec.ranks))
    keep = remap[runs.dest] >= 0
    kept = runs.take(np.flatnonzero(keep))
    stage_cols = {c: [] for c in STAGE_COLUMNS}
    span_cols = {c: [] for c in SPAN_COLUMNS}
    order = np.lexsort((runs.dst_off, runs.dest))
    by_dest = runs.take(order[~keep[order]])
    bounds = np.searchsorted(by_dest.dest, sorted(stage_of) + [len(program.dests)]) if stage_of else []
    for i, d in enumerate(sorted(stage_of)):
        lo, hi = bounds[i], bounds[i + 1]
        part = by_dest.take(np.arange(lo, hi))
        _place_one(stage_of[d], program.dests[d].shape, part, stage_cols, span_cols)
    placement = QuantPlacement(
        tuple(staging),
        {c: np.array(v, dtype=np.int64) for c, v in stage_cols.items()},
        {c: np.array(v, dtype=np.int64) for c, v in span_cols.items()},
    )
    new_runs = dataclasses.replace(kept, dest=remap[kept.dest])
    return dataclasses.replace(program, dests=tuple(dests), runs=new_runs, meta=dict(program.meta, quant_placement=placement))


def block_ranges(shape: tuple[int, ...], off: int, length: int) -> list[tuple[int, int]]:
    """Flat block-id ranges [lo, hi) touched by elements [off, off + length) of a 2-D/3-D tensor (may overlap)."""
    rows, cols = shape[-2:]
    _, nbr, nbc = block_grid(shape)

    def band(g: int) -> int:
        return (g // rows) * nbr + (g % rows) // BLOCK

    g0, c0 = divmod(off, cols)
    g1, c1 = divmod(off + length - 1, cols)
    if g0 == g1:
        return [(band(g0) * nbc + c0 // BLOCK, band(g0) * nbc + c1 // BLOCK + 1)]
    out = [(band(g0) * nbc + c0 // BLOCK, band(g0) * nbc + nbc)]
    if g1 - g0 > 1:
        out.append((band(g0 + 1) * nbc, (band(g1 - 1) + 1) * nbc))
    out.append((band(g1) * nbc, band(g1) * nbc + c1 // BLOCK + 1))
    return out


def block_owners(shape: tuple[int, ...], offs, lengths, ranks) -> np.ndarray:
    """Per flat block: the one trainer rank whose runs write it, or -1 (several ranks, or none)."""
    matrices, nbr, nbc = block_grid(shape)
    owner = np.full(matrices * nbr * nbc, -1, dtype=np.int64)
    shared = np.zeros(len(owner), dtype=bool)
    for off, length, rank in zip(offs, lengths, ranks):
        for lo, hi in block_ranges(shape, off, length):
            seen = owner[lo:hi]
            shared[lo:hi] |= (seen >= 0) & (seen != rank)
            owner[lo:hi] = rank
    owner[shared] = -1
    return owner


def _place_one(stage: int, shape, runs, stage_cols: dict, span_cols: dict) -> None:
    offs, lengths, ranks = runs.dst_off.tolist(), runs.length.tolist(), runs.src_rank.tolist()
    owner = block_owners(shape, offs, lengths, ranks)
    change = np.flatnonzero(np.diff(owner)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(owner)]])
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        rank = int(owner[lo])
        for column, value in zip(SPAN_COLUMNS, (stage, lo, hi - lo, QuantPlacement.SENDER if rank >= 0 else QuantPlacement.RECEIVER, rank)):
            span_cols[column].append(value)
    for i, (off, length, rank) in enumerate(zip(offs, lengths, ranks)):
        touched = np.concatenate([owner[lo:hi] for lo, hi in block_ranges(shape, off, length)])
        for side, needed in ((QuantPlacement.SENDER, (touched >= 0).any()), (QuantPlacement.RECEIVER, (touched < 0).any())):
            if needed:
                row = (side, rank, int(runs.src[i]), int(runs.src_off[i]), stage, off, length, int(runs.wire[i]))
                for column, value in zip(STAGE_COLUMNS, row):
                    stage_cols[column].append(value)
