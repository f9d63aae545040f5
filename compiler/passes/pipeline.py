"""pipeline: every pass declared once, by stage, with what it requires and ensures; runs a stage, checking after each pass when asked."""

from __future__ import annotations

import enum
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.plan.invariants import fanout_problem
from ..ir import Program
from .check_coverage import check_coverage, with_post_load_padding
from .coalesce import coalesce
from .expand_layers import expand_layers
from .fold_views import fold_views
from .lower_constants import lower_constants
from .lower_runs import lower_runs
from .merge_ranks import merge_ranks
from .place_fanout import place_fanout
from .place_quant import place_quant
from .split_expert_slots import misaligned_runs, split_expert_slots
from .split_shards import split_shards
from .verify import verify
from .verify_quant import verify_quant


class Stage(enum.Enum):
    PER_RANK = "per-rank"  # one inference rank's traced assignments -> its runs and constants
    JOIN = "join"  # the per-rank programs -> one program for all ranks
    WHOLE_PLAN = "whole-plan"  # trainer shards, fewest rows, the coverage proof
    EPLB = "eplb"  # --inference ...,eplb=R: runs into expert tensors cut at physical slot boundaries
    QUANT = "quant"  # fp8_per_block: where each 128x128 block is quantized
    FANOUT = "fanout"  # gpus-per-node: which rank of each node pulls each replicated entry


class Fact(enum.Enum):
    """What a program is known to satisfy; passes require some and ensure others."""

    TRACED = "traced"  # assignments and fills from the tracer, one inference rank
    COPIES = "copies"  # assignments folded into strided copies
    RUNS = "runs"  # copies lowered to runs (global source offsets)
    CONSTANTS = "constants"  # fills lowered to constant runs
    ALL_LAYERS = "all-layers"  # every reused decoder layer has its runs and constants
    MERGED = "merged"  # one program for all inference ranks; destinations list their ranks
    SHARDED = "sharded"  # each run read from one trainer rank's shard, at local offsets
    COALESCED = "coalesced"  # runs continuing each other merged
    COVERED = "covered"  # every destination byte written exactly once (proved)
    SLOT_ALIGNED = "slot-aligned"  # every run into an EPLB expert tensor lies inside one physical slot
    QUANT_PLACED = "quant-placed"  # quantized tensors replaced by fp8 weight + scale, every block placed
    FANNED_OUT = "fanned-out"  # replicated entries pulled once per node, read by the node's other holders from the puller


@dataclass(frozen=True)
class Pass:
    run: Callable  # Program -> Program (the join: list[Program] -> Program)
    stage: Stage
    requires: frozenset[Fact]
    ensures: frozenset[Fact]
    applies: Callable[[Program], bool] = lambda program: True
    checked: bool = False  # its result is checked in production too, not only with check_each

    @property
    def name(self) -> str:
        return self.run.__name__


def _facts(*facts: Fact) -> frozenset[Fact]:
    return frozenset(facts)


PIPELINE: tuple[Pass, ...] = (
    Pass(fold_views, Stage.PER_RANK, _facts(Fact.TRACED), _facts(Fact.COPIES)),
    Pass(lower_runs, Stage.PER_RANK, _facts(Fact.COPIES), _facts(Fact.RUNS)),
    Pass(lower_constants, Stage.PER_RANK, _facts(Fact.RUNS), _facts(Fact.CONSTANTS)),
    Pass(expand_layers, Stage.PER_RANK, _facts(Fact.RUNS, Fact.CONSTANTS), _facts(Fact.ALL_LAYERS)),
    Pass(merge_ranks, Stage.JOIN, _facts(Fact.ALL_LAYERS), _facts(Fact.MERGED)),
    Pass(split_shards, Stage.WHOLE_PLAN, _facts(Fact.MERGED), _facts(Fact.SHARDED)),
    Pass(coalesce, Stage.WHOLE_PLAN, _facts(Fact.SHARDED), _facts(Fact.COALESCED)),
    Pass(check_coverage, Stage.WHOLE_PLAN, _facts(Fact.COALESCED), _facts(Fact.COVERED)),
    Pass(split_expert_slots, Stage.EPLB, _facts(Fact.COVERED), _facts(Fact.SLOT_ALIGNED),
         applies=lambda program: program.origin is not None and program.origin.inference.eplb is not None, checked=True),
    Pass(place_quant, Stage.QUANT, _facts(Fact.COVERED), _facts(Fact.QUANT_PLACED),
         applies=lambda program: bool(program.quant_targets), checked=True),
    Pass(place_fanout, Stage.FANOUT, _facts(Fact.COVERED), _facts(Fact.FANNED_OUT),
         applies=lambda program: program.gpus_per_node > 0, checked=True),
)


class PassCheckError(WeightplanError):
    """A pass ran without what it requires, or left a program that breaks an invariant; names the pass."""


Observer = Callable[[str, Program, float], None]  # (pass name, its result, its wall seconds)


def passes(stage: Stage, pipeline: Sequence[Pass] | None = None) -> tuple[Pass, ...]:
    """The passes of `stage`, in declared order (of PIPELINE unless another pipeline is given)."""
    return tuple(p for p in (PIPELINE if pipeline is None else pipeline) if p.stage is stage)


def run_stage(stage: Stage, program: Program, *, check_each: bool = False, facts: frozenset[Fact] | None = None,
              observe: Observer | None = None, pipeline: Sequence[Pass] | None = None) -> Program:
    """Run one stage's passes in declared order.

    `facts` is what `program` satisfies on entry (default: what the earlier stages ensure).
    With `check_each`, every pass's result is verified (bounds, strides, dtypes, no byte written
    twice, and what the pass ensures) and a failure names the pass. `observe(name, program)` sees
    each result and its wall time (timings, statistics).
    """
    if stage is Stage.JOIN:
        raise ValueError("the join stage takes the per-rank programs: use join_ranks")
    steps = passes(stage, pipeline)
    held = set(_entry_facts(stage, pipeline, program) if facts is None else facts)
    for step in steps:
        if not step.applies(program):
            continue
        program = _run(step, program, held, check_each, observe)
    return program


def join_ranks(programs: list[Program], cast_chains: tuple, *, check_each: bool = False,
               observe: Observer | None = None, pipeline: Sequence[Pass] | None = None) -> Program:
    """The join stage: one program for all inference ranks from each rank's per-rank result."""
    (step,) = passes(Stage.JOIN, pipeline)
    start = time.perf_counter()
    joined = step.run(programs, cast_chains)
    return _finish(step, joined, time.perf_counter() - start, check_each, observe, step.requires | step.ensures)


def run_all(program: Program, *, check_each: bool = False, observe: Observer | None = None,
            pipeline: Sequence[Pass] | None = None) -> Program:
    """Every stage on one traced single-rank program, as compile_plan runs them (the Python API, docs/python-api.md)."""
    program = run_stage(Stage.PER_RANK, program, check_each=check_each, observe=observe, pipeline=pipeline)
    program = join_ranks([program], program.cast_chains, check_each=check_each, observe=observe, pipeline=pipeline)
    program = run_stage(Stage.WHOLE_PLAN, program, check_each=check_each, observe=observe, pipeline=pipeline)
    program = run_stage(Stage.EPLB, program, check_each=check_each, observe=observe, pipeline=pipeline)
    program = run_stage(Stage.QUANT, program, check_each=check_each, observe=observe, pipeline=pipeline)
    return run_stage(Stage.FANOUT, program, check_each=check_each, observe=observe, pipeline=pipeline)


def _entry_facts(stage: Stage, pipeline, program: Program) -> frozenset[Fact]:
    """What a program entering `stage` satisfies: it was traced, and every earlier stage ran (its passes that apply
    to this program: what decides whether a pass applies, e.g. the quant targets, does not change along the pipeline)."""
    earlier = list(Stage)[: list(Stage).index(stage)]
    return frozenset({Fact.TRACED}).union(*(p.ensures for s in earlier for p in passes(s, pipeline) if p.applies(program)))


def _run(step: Pass, program: Program, held: set[Fact], check_each: bool, observe) -> Program:
    missing = step.requires - held
    if missing:
        raise PassCheckError(f"pass {step.name} requires {', '.join(sorted(f.value for f in missing))}, "
                             f"which no earlier pass ensures here")
    start = time.perf_counter()
    program = step.run(program)
    held |= step.ensures
    return _finish(step, program, time.perf_counter() - start, check_each, observe, frozenset(held))


def _finish(step: Pass, program: Program, seconds: float, check_each: bool, observe,
            held: frozenset[Fact] | None = None) -> Program:
    if observe is not None:
        observe(step.name, program, seconds)
    if os.environ.get("WEIGHTPLAN_DEBUG"):
        _dump(step.name, program, seconds)
    if check_each or step.checked:
        try:
            check(program, step.ensures if held is None else held)
        except WeightplanError as e:
            raise PassCheckError(f"after pass {step.name}: {e}") from e
    return program


def check(program: Program, held: frozenset[Fact] = frozenset()) -> None:
    """Verify what `program` must satisfy given the facts `held`: once runs exist their invariants, once
    every layer has its runs and constants every destination byte written exactly once, EPLB runs inside one
    physical slot each, the fp8 block placement, and that node-local fan-out keeps every holder's bytes written
    exactly once."""
    if program.runs is not None:
        full = {Fact.CONSTANTS, Fact.ALL_LAYERS} <= held and Fact.QUANT_PLACED not in held  # placed fp8: by quantizers
        verify(with_post_load_padding(program) if full else program, require_full_coverage=full)
    if Fact.COVERED in held and program.coverage is None:
        raise PassCheckError("coverage was not proved")
    if Fact.SLOT_ALIGNED in held:
        check_slot_aligned(program)
    if Fact.QUANT_PLACED in held:
        q = program.quant_placement
        if q is None:
            raise PassCheckError("no fp8 block placement was recorded")
        verify_quant([shape for _, shape, _, _, _ in q.staging], [len(ranks) for _, _, ranks, _, _ in q.staging],
                     q.stage, q.spans)
    if Fact.FANNED_OUT in held:
        pairs = [(w, s) for *_, w, s in (program.quant_placement.staging if program.quant_placement else ())]
        problem = "no fan-out was recorded" if program.fanout is None else fanout_problem(program.dests, pairs, program.fanout)
        if problem:
            raise PassCheckError(f"fan-out: {problem}")


def check_slot_aligned(program: Program) -> None:
    """Raise PassCheckError naming the first run into an EPLB expert tensor that writes bytes of two physical slots."""
    bad = misaligned_runs(program)
    if len(bad):
        r = program.runs
        i = int(bad[0])
        raise PassCheckError(f"{len(bad)} runs cross an EPLB slot boundary; the first writes "
                             f"{program.dests[r.dest[i]].name} at element {r.dst_off[i]} ({r.count[i]} rows of "
                             f"{r.length[i]}, stride {r.dst_stride[i]}), past the slot it starts in")


def _dump(name: str, program: Program, seconds: float) -> None:
    print(f"== after {name} ({seconds:.3f} s): {len(program.copies)} copies, {len(program.fills)} fills, "
          f"{len(program.runs or ())} runs, {len(program.constants)} constant runs", file=sys.stderr)
    for copy in program.copies[:20]:
        print(f"   {copy}", file=sys.stderr)
