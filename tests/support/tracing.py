"""Trace small hand-written loaders into IR programs, and read their runs back as rows (pass tests)."""

from __future__ import annotations

import torch

from weightplan.compiler.frontend.lazy_weight import LazyWeight, WriteRecorder, tracing
from weightplan.compiler.ir import Program, TensorEntry

W46 = {"w": ((4, 6), "float32")}


def trace(sources: dict, dests: dict, body) -> Program:
    """Trace `body(w, d)`; w: name -> LazyWeight, d: name -> meta destination. Specs are (shape, dtype)."""
    metas = {n: torch.empty(s, dtype=getattr(torch, dt), device="meta") for n, (s, dt) in dests.items()}
    tracer = WriteRecorder(metas)
    with tracing(tracer):
        lazy = {n: LazyWeight.source(n, s, getattr(torch, dt)) for n, (s, dt) in sources.items()}
        body(lazy, metas)
    return Program(
        sources=tuple(TensorEntry(n, tuple(s), dt) for n, (s, dt) in sources.items()),
        dests=tuple(TensorEntry(n, tuple(s), dt) for n, (s, dt) in dests.items()),
        assignments=tuple(tracer.assignments),
    )


def runs_table(program: Program) -> list[tuple[int, ...]]:
    """Runs as (src, src_off, dest, dst_off, length, wire) rows (strided runs expanded), in their stored order."""
    r = program.runs.expand()
    return list(zip(*(getattr(r, f).tolist() for f in ("src", "src_off", "dest", "dst_off", "length", "wire"))))
