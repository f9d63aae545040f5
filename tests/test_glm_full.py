"""Full-size GLM-5.2: the checked-in plans are what the compiler produces now, and they verify against vLLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from weightplan.compiler.compile import compile_plan, default_plan_path
from weightplan.compiler.make_plans import CHECKED_IN
from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan
from weightplan.runtime.plan.schema import GATHER, SENDER

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fresh_plans(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm")
    out = {}
    for options in CHECKED_IN:
        draft = "mtp-" if options.draft else ""
        path = root / f"{draft}{options.trainer_format}-{options.trainer_dtype}-{options.trainer}-{options.inference}-{options.quant}.plan"
        result = compile_plan(options.__class__(**{**options.__dict__, "output": path}))
        out[options] = (path, result)
    return out


@pytest.mark.parametrize("index", range(len(CHECKED_IN)))
def test_checked_in_plan_is_not_stale(fresh_plans, index):
    options = CHECKED_IN[index]
    path, result = fresh_plans[options]
    checked_in = REPO / default_plan_path("glm-5.2", result.program.origin.trainer, result.program.origin.inference, options.quant)
    assert checked_in.exists(), f"{checked_in} is missing: run `make plan` and commit plans/"
    assert checked_in.read_bytes() == path.read_bytes(), f"{checked_in} is stale: run `make plan` and commit plans/"


@pytest.mark.parametrize("index", range(len(CHECKED_IN)))
def test_full_glm_plan_is_complete_and_minimal(fresh_plans, index):
    path, result = fresh_plans[CHECKED_IN[index]]
    assert result.stats["dst_coverage"] == 1.0
    assert result.stats["descriptors"] == result.stats["descriptors_lower_bound"]
    if result.stats.get("guard", "off") not in ("off", "not run"):  # DP ranks shared one model per TP rank: the guard let them
        assert result.stats["guard"].startswith("passed"), result.stats["guard"]
    summary = summarize(load_plan(path))
    assert summary["dst_coverage"] == 1.0
    assert summary["src_balance"] <= 1.10
    if summary["dst_ranks"] == 1:
        assert summary["dst_bytes"] > 1.4e12  # ~744B parameters in bf16


# Seed 1 samples, in the tp=8 plan, a row-parallel o_proj and shared-expert down_proj: column
# slices stored as strided runs, cut at the 64 FSDP row boundaries (512 strided runs each).
# (Seed 5 adds a routed w2_weight, 256 experts' strided runs; it passes too, but needs 11.7 GB.)
# Index 5 is the MTP draft's plan (compile-plan --draft), verified against vLLM's own draft model.
@pytest.mark.parametrize("index,seed", [(0, 3), (1, 1), (2, 3), (5, 2)])
def test_full_glm_sampled_verify_matches_vllm(fresh_plans, index, seed):
    path, _ = fresh_plans[CHECKED_IN[index]]
    result = verify_plan(path, sample=4, seed=seed)
    assert result.mismatches == ()
    assert result.tensors >= 4


# The fp8 seed plan (index 4), both kinds of quantized module at full size against vLLM's own online
# fp8_per_block: seed 1 samples a routed-expert module (w2 with w13 and the scales, 8 experts on
# inference rank 1, quantized on the trainer ranks that hold them); on inference rank 0, seed 5 samples
# two fused_qkv_a_proj and an indexer wq_b, replicated tensors whose straddling blocks are gathered.
@pytest.mark.parametrize("sample,seed,ranks", [(1, 1, None), (3, 5, [0])], ids=["expert-module", "gathered-dense"])
def test_full_glm_fp8_sampled_verify_matches_vllm(fresh_plans, sample, seed, ranks):
    options = CHECKED_IN[4]
    assert options.quant == "fp8_per_block"
    path, _ = fresh_plans[options]
    result = verify_plan(path, sample=sample, seed=seed, ranks=ranks)
    assert result.mismatches == ()
    assert result.tensors == len(result.compared) >= 2 * sample
    plan = load_plan(path)
    compared = {c.split(" (")[0] for c in result.compared}
    stages = [i for i, e in enumerate(plan.staging) if plan.dests[e.weight].name in compared]
    assert stages and all(plan.dests[plan.staging[i].scale].name in compared for i in stages)
    sides = set(plan.spans["side"][np.isin(plan.spans["stage"], stages)].tolist())
    assert sides == ({SENDER} if ranks is None else {GATHER})
