"""Differential tests: executing a plan gives exactly the bytes vLLM's own load_weights gives."""

from __future__ import annotations

import pytest

from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

from ..conftest import TINY_MODELS, config_dir

CASES = [(model, fmt, dtype) for model in TINY_MODELS for fmt in ("hf", "stacked") for dtype in ("bf16", "fp32")]


@pytest.mark.parametrize("model,fmt,dtype", CASES)
def test_plan_matches_vllm_load_weights(plan_cache, model, fmt, dtype):
    path = plan_cache(model, fmt, dtype)
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir(model)), seed=1)
    assert result.mismatches == ()
    assert result.tensors == len(plan.dests)
    assert result.bytes == sum(entry.nbytes for entry in plan.dests)


def test_fp32_masters_carry_the_cast_in_the_chain(plan_cache):
    plan = load_plan(plan_cache("tiny-glm", "stacked", "fp32"))
    assert ("float32", "bfloat16") in plan.cast_chains
    assert {entry.dtype for entry in plan.sources} == {"float32"}


def test_stacked_experts_coalesce_into_one_run_per_fused_tensor(plan_cache):
    """Every expert's gate and up rows land in one w13_weight: one descriptor for the whole layer."""
    plan = load_plan(plan_cache("tiny-glm", "stacked", "bf16"))
    names = [entry.name for entry in plan.dests]
    w13 = [i for i, n in enumerate(names) if n.endswith("w13_weight")]
    assert w13
    for index in w13:
        runs = plan.runs["dest"] == index
        assert runs.sum() == 1
        assert plan.runs["length"][runs][0] == plan.dests[index].numel


def test_verify_detects_a_corrupted_run(plan_cache, tmp_path):
    """The digest comparison is a real check: a plan whose two same-sized runs read each other's source must fail
    (the reader accepts it: every destination element is still written once)."""
    from weightplan.runtime.plan.format import write_plan
    from weightplan.runtime.plan.schema import RUN_COLUMNS

    plan = load_plan(plan_cache("tiny-llama", "hf", "bf16"))
    runs = {c: plan.table[c].copy() for c in RUN_COLUMNS}
    long_runs = [i for i in range(plan.n_stored_runs) if runs["length"][i] > 2 and runs["count"][i] == 1]
    a, b = next((i, j) for i in long_runs for j in long_runs if i < j and runs["length"][i] == runs["length"][j]
                and runs["src_off"][i] == runs["src_off"][j] and runs["src"][i] != runs["src"][j]
                and plan.sources[runs["src"][i]].dtype == plan.sources[runs["src"][j]].dtype)
    runs["src"][[a, b]] = runs["src"][[b, a]]
    bad = write_plan(tmp_path / "bad.plan", plan.header, runs)
    result = verify_plan(bad, model=str(config_dir("tiny-llama")))
    assert set(result.mismatches) == {f"{plan.dests[runs['dest'][i]].name} (inference rank 0)" for i in (a, b)}
