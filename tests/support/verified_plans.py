"""A compiled test plan proven before use: vLLM's own load on every rank, coverage and the descriptor bound."""

from __future__ import annotations

from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

from ..conftest import config_dir


def verified_plan(plan_cache, model, fmt, dtype, trainer, inference, seed=2):
    """The compiled plan, after checking it against vLLM's own load on every rank, its coverage and descriptor bound."""
    path = plan_cache(model, fmt, dtype, trainer, inference)
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir(model)), seed=seed)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests)
    summary = summarize(plan)
    assert summary["dst_coverage"] == 1.0
    assert summary["descriptors"] == summary["descriptors_lower_bound"]
    assert len(summary["bytes_per_src_rank"]) == plan.header.src_ranks
    assert len(summary["bytes_per_dst_rank"]) == plan.header.dst_ranks
    return plan
