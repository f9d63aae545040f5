"""plan_writer: serialize a compiled Program into the runtime's plan format (schema owned by runtime/plan/header.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from weightplan.runtime.plan.format import write_plan
from weightplan.runtime.plan.header import PlanHeader
from weightplan.runtime.plan.columns import BlockSpans, StageRuns
from weightplan.runtime.plan.schema import ConstantRun, StagingEntry
from .ir import Program, QuantPlacement


def plan_header(program: Program) -> PlanHeader:
    """The program's origin (model, layouts, versions), its tensor tables and compile statistics."""
    origin, layout = program.origin, program.trainer_layout
    return PlanHeader(
        vllm_version=origin.vllm_version,
        model=origin.model,
        config_sha256=origin.config_sha256,
        architecture=origin.architecture,
        trainer=origin.trainer,
        inference=dataclasses.replace(origin.inference, unloaded=program.unloaded),
        quant=origin.quant,
        src_ranks=origin.src_ranks,
        dst_ranks=origin.dst_ranks,
        sources=tuple(dataclasses.replace(s, box_class=layout.of[layout.index(s.name)]) for s in program.sources),
        dests=program.dests,
        cast_chains=program.cast_chains,
        staging=tuple(StagingEntry(n, tuple(shape), "bfloat16", tuple(ranks), w, s) for n, shape, ranks, w, s in _quant(program).staging),
        quant_layout=program.kernel_layout,
        derived=program.derived,
        stats=program.stats,
        constants=_constants(program),
        fanout=program.fanout,
    )


def _constants(program: Program) -> tuple[ConstantRun, ...]:
    """The header's constants table, sorted by (dest, dst_off)."""
    c = program.constants
    order = np.lexsort((c.dst_off, c.dest)).tolist()
    return tuple(ConstantRun(int(c.dest[i]), int(c.dst_off[i]), int(c.length[i]), c.values[i]) for i in order)


def _quant(program: Program) -> QuantPlacement:
    return program.quant_placement or QuantPlacement((), StageRuns.empty(), BlockSpans.empty())


def write_program(program: Program, path: Path) -> int:
    """Write atomically; returns the file size."""
    runs, quant = program.runs, _quant(program)
    written = write_plan(path, plan_header(program), runs, quant.stage or None, quant.spans or None)
    return written.stat().st_size
