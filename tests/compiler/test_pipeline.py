"""The declared pass pipeline: checked after every pass it is the production pipeline, and a broken pass is named."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.conftest import config_dir
from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.ir import Runs
from weightplan.compiler.passes import pipeline
from weightplan.compiler.passes.pipeline import PIPELINE, Fact, Pass, PassCheckError, Stage, run_all
from weightplan.compiler.passes.verify import PlanInvariantError

from ..support.pipeline_runs import timer
from ..support.tracing import W46, runs_table, trace

SEED_ANALOGUE = ("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep", "none")  # the seed topology, small
FP8_CASE = ("fp8-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=2,ep", "fp8_per_block")


def _program():
    return trace(W46, {"d": ((4, 6), "float32")}, lambda w, d: (d["d"][2:].copy_(w["w"][2:]), d["d"][:2].copy_(w["w"][:2])))


def _replaced(name: str, run) -> tuple[Pass, ...]:
    return tuple(dataclasses.replace(p, run=run) if p.name == name else p for p in PIPELINE)


def test_every_stage_and_pass_is_declared_once_in_order():
    names = [p.name for p in PIPELINE]
    assert names == ["fold_views", "lower_runs", "lower_constants", "expand_layers", "merge_ranks", "split_shards", "coalesce",
                     "check_coverage", "split_expert_slots", "place_quant", "place_fanout"]
    assert [p.stage for p in PIPELINE] == sorted((p.stage for p in PIPELINE), key=list(Stage).index)
    ensured = {Fact.TRACED}
    for p in PIPELINE:  # each pass requires only what an earlier pass ensures
        assert p.requires <= ensured, p.name
        ensured |= p.ensures


@pytest.mark.parametrize("case", [SEED_ANALOGUE, FP8_CASE], ids=["seed-analogue", "fp8"])
def test_checked_pipeline_is_the_production_pipeline(case, plan_cache, tmp_path):
    model, fmt, dtype, trainer, inference, quant = case
    timings = {}
    checked = tmp_path / "checked.plan"
    original = pipeline._finish

    def counting(step, program, seconds, check_each, *rest):
        timings[step.name] = timings.get(step.name, 0) + 1
        assert check_each, step.name
        return original(step, program, seconds, check_each, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_finish", counting)
        compile_plan(CompileOptions(str(config_dir(model)), fmt, dtype, quant, checked, trainer=trainer,
                                    inference=inference, check_passes=True))
    ranks = 4 if inference.startswith("dp=4") else 2
    expected = {"fold_views": ranks, "lower_runs": ranks, "lower_constants": ranks, "expand_layers": ranks, "merge_ranks": 1,
                "split_shards": 1,
                "coalesce": 1, "check_coverage": 1}
    if quant != "none":
        expected["place_quant"] = 1
    assert timings == expected
    # The same bytes as the plan compiled without per-pass checks.
    assert checked.read_bytes() == plan_cache(model, fmt, dtype, trainer, inference, quant).read_bytes()


def _doubles_first_run(program):
    runs = program.runs
    return dataclasses.replace(program, runs=Runs.concat([runs, runs.take(np.array([0]))]))


def _drops_last_run(program):
    runs = program.runs
    return dataclasses.replace(program, runs=runs.take(np.arange(len(runs) - 1)))


def test_a_pass_writing_a_byte_twice_is_named():
    def coalesce_twice(program):
        return _doubles_first_run(pipeline.coalesce(program))

    broken = _replaced("coalesce", coalesce_twice)
    with pytest.raises(PassCheckError, match=r"after pass coalesce_twice: destination bytes written twice: d element 0"):
        run_all(_program(), check_each=True, pipeline=broken)


def test_a_pass_losing_bytes_is_named_by_the_checks_and_refused_without_them():
    def lossy_split_shards(program):
        return _drops_last_run(pipeline.split_shards(program))

    broken = _replaced("split_shards", lossy_split_shards)
    with pytest.raises(PassCheckError, match=r"after pass lossy_split_shards: .*not fully written"):
        run_all(_program(), check_each=True, pipeline=broken)
    # Without per-pass checks the production pipeline still refuses it: the coverage proof always runs.
    with pytest.raises(PlanInvariantError, match=r"not fully written"):
        run_all(_program(), pipeline=broken)


def test_a_pass_run_without_what_it_requires_is_named():
    out_of_order = tuple(p for p in PIPELINE if p.name != "lower_runs")
    with pytest.raises(PassCheckError, match=r"pass lower_constants requires runs"):
        run_all(_program(), pipeline=out_of_order)


def test_the_observer_sees_each_pass_and_the_result_is_unchanged():
    timings = {}
    program = run_all(_program(), observe=timer(timings))
    assert runs_table(program) == [(0, 0, 0, 0, 24, 0)]
    assert all(seconds >= 0 for seconds in timings.values()) and "place_quant" not in timings


def test_debug_switch_prints_each_pass(monkeypatch, capsys):
    monkeypatch.setenv("WEIGHTPLAN_DEBUG", "1")
    run_all(_program())
    err = capsys.readouterr().err
    assert [line.split(" (")[0] for line in err.splitlines() if line.startswith("== after")] == [
        f"== after {name}" for name in ("fold_views", "lower_runs", "lower_constants", "expand_layers", "merge_ranks",
                                        "split_shards", "coalesce", "check_coverage")]
