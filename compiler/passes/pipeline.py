"""pipeline: run the passes in order, verifying after each when asked (WEIGHTPLAN_DEBUG prints the IR)."""

from __future__ import annotations

import os
import sys
import time

from ..ir import Program
from .coalesce import coalesce
from .fold_views import fold_views
from .lower_constants import lower_constants
from .lower_runs import lower_runs
from .split_shards import split_shards
from .verify import verify

PASSES = (fold_views, lower_runs, lower_constants, split_shards, coalesce)


def run_passes(
    program: Program,
    *,
    check_each: bool = False,
    timings: dict | None = None,
    start_at: str | None = None,
    stop_before: str | None = None,
) -> Program:
    """Run PASSES in order (optionally a slice of them, by pass name)."""
    names = [p.__name__ for p in PASSES]
    first = names.index(start_at) if start_at else 0
    last = names.index(stop_before) if stop_before else len(names)
    debug = os.environ.get("WEIGHTPLAN_DEBUG")
    for compiler_pass in PASSES[first:last]:
        start = time.perf_counter()
        program = compiler_pass(program)
        if timings is not None:
            timings[compiler_pass.__name__] = time.perf_counter() - start
        if debug:
            _dump(compiler_pass.__name__, program)
        if check_each and program.runs is not None:
            verify(program)
    return program


def _dump(name: str, program: Program) -> None:
    print(f"== after {name}: {len(program.copies)} copies, {len(program.fills)} fills, {len(program.runs or ())} runs, "
          f"{len(program.constants)} constant runs", file=sys.stderr)
    for copy in program.copies[:20]:
        print(f"   {copy}", file=sys.stderr)
