"""Run the whole declared pipeline on one traced single-rank program, as compile_plan runs its stages (tests only)."""

from __future__ import annotations

from collections.abc import Sequence

from weightplan.compiler.ir import Program
from weightplan.compiler.passes.pipeline import Observer, Pass, Stage, join_ranks, run_stage


def run_all(program: Program, *, check_each: bool = False, observe: Observer | None = None,
            pipeline: Sequence[Pass] | None = None) -> Program:
    """Every stage on one traced single-rank program, as compile_plan runs them."""
    program = run_stage(Stage.PER_RANK, program, check_each=check_each, observe=observe, pipeline=pipeline)
    program = join_ranks([program], program.cast_chains, check_each=check_each, observe=observe, pipeline=pipeline)
    program = run_stage(Stage.WHOLE_PLAN, program, check_each=check_each, observe=observe, pipeline=pipeline)
    program = run_stage(Stage.QUANT, program, check_each=check_each, observe=observe, pipeline=pipeline)
    return run_stage(Stage.FANOUT, program, check_each=check_each, observe=observe, pipeline=pipeline)


def timer(timings: dict[str, float]) -> Observer:
    """An observer adding each pass's wall time to `timings[name]`."""

    def observe(name: str, program: Program, seconds: float) -> None:
        timings[name] = timings.get(name, 0.0) + seconds

    return observe

