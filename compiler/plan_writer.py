"""plan_writer: serialize a compiled Program into the runtime's plan format (schema owned by runtime)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ..runtime.plan.format import write_plan
from ..runtime.plan.schema import ConstantRun, StagingEntry
from .ir import Program, QuantPlacement


def plan_header(program: Program) -> dict:
    """Header fields: the program's origin (model, layouts, versions) and its tensor tables."""
    origin, layout = program.origin, program.trainer_layout
    return {
        "vllm_version": origin.vllm_version,
        "model": origin.model,
        "config_sha256": origin.config_sha256,
        "architecture": origin.architecture,
        "trainer": origin.trainer,
        "inference": {**origin.inference, **({"unloaded": [d.dest_row() for d in program.unloaded]} if program.unloaded else {})},
        "quant": origin.quant,
        "src_ranks": origin.src_ranks,
        "dst_ranks": origin.dst_ranks,
        "sources": [dataclasses.replace(s, box_class=layout.of[layout.index(s.name)]).source_row() for s in program.sources],
        "dests": [d.dest_row() for d in program.dests],
        "cast_chains": [list(c) for c in program.cast_chains],
        "stats": program.stats,
        "staging": [StagingEntry(n, tuple(shape), "bfloat16", tuple(ranks), w, s).row()
                    for n, shape, ranks, w, s in _quant(program).staging],
        "quant_layout": program.kernel_layout,
        "derived": [d.row() for d in program.derived],
        **_constants(program),
        **({"fanout": program.fanout.row()} if program.fanout is not None else {}),
    }


def _constants(program: Program) -> dict:
    """The header's constants table, sorted by (dest, dst_off); no key at all when there are none."""
    c = program.constants
    if not len(c):
        return {}
    order = np.lexsort((c.dst_off, c.dest)).tolist()
    return {"constants": [ConstantRun(int(c.dest[i]), int(c.dst_off[i]), int(c.length[i]), c.values[i]).row() for i in order]}


def _quant(program: Program) -> QuantPlacement:
    return program.quant_placement or QuantPlacement((), {}, {})


def write_program(program: Program, path: Path) -> int:
    """Write atomically; returns the file size."""
    runs, quant = program.runs, _quant(program)
    written = write_plan(path, plan_header(program), runs, quant.stage or None, quant.spans or None)
    return written.stat().st_size
