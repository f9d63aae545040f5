"""plan_writer: serialize a compiled Program into the runtime's plan format (schema owned by runtime)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..runtime.plan.format import write_plan
from ..runtime.plan.schema import ConstantRun, StagingEntry
from .ir import Program, QuantPlacement


def plan_header(program: Program) -> dict:
    """Header fields derived from the program; `program.meta` supplies model/layout/version facts."""
    meta = program.meta
    layout = meta["trainer_layout"]
    return {
        "vllm_version": meta["vllm_version"],
        "model": meta["model"],
        "config_sha256": meta["config_sha256"],
        "architecture": meta["architecture"],
        "trainer": meta["trainer"],
        "inference": meta["inference"],
        "quant": meta["quant"],
        "src_ranks": meta["src_ranks"],
        "dst_ranks": meta["dst_ranks"],
        "sources": [dataclasses.replace(s, box_class=layout.of[layout.index(s.name)]).source_row() for s in program.sources],
        "dests": [d.dest_row() for d in program.dests],
        "cast_chains": [list(c) for c in program.cast_chains],
        "stats": meta.get("stats", {}),
        "staging": [StagingEntry(n, tuple(shape), "bfloat16", tuple(ranks), w, s).row()
                    for n, shape, ranks, w, s in _quant(program).staging],
        "quant_layout": meta.get("quant_layout", {}),
        "derived": meta.get("derived", []),
        **_constants(program),
    }


def _constants(program: Program) -> dict:
    """The header's constants table, sorted by (dest, dst_off); no key at all when there are none."""
    c = program.constants
    if not len(c):
        return {}
    order = np.lexsort((c.dst_off, c.dest)).tolist()
    return {"constants": [ConstantRun(int(c.dest[i]), int(c.dst_off[i]), int(c.length[i]), c.values[i]).row() for i in order]}


def _quant(program: Program) -> QuantPlacement:
    return program.meta.get("quant_placement") or QuantPlacement((), {}, {})


def write_program(program: Program, path: Path) -> int:
    """Write atomically; returns the file size."""
    runs, quant = program.runs, _quant(program)
    written = write_plan(path, plan_header(program), runs, quant.stage or None, quant.spans or None)
    return written.stat().st_size
