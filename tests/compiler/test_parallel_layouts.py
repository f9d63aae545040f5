"""Sharded trainers to parallel vLLM layouts: digests identical to vLLM's own load on every inference rank."""

from __future__ import annotations

import numpy as np
import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.plan_summary import summarize
from weightplan.runtime import load_plan

from ..conftest import config_dir
from ..support.verified_plans import verified_plan

CASES = [
    ("tiny-glm", "hf", "fp32", "fsdp=4", "tp=2"),
    ("tiny-qwen3-moe", "hf", "bf16", "fsdp=4", "tp=2"),
    ("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep"),
    ("tiny-qwen3-moe", "stacked", "fp32", "fsdp=4,ep=2", "dp=4,ep"),
    ("tiny-glm", "hf", "bf16", "fsdp=3", "tp=2"),  # uneven and empty chunks (e.g. 4 indexer heads over 3 ranks)
    ("tiny-deepseek-v3", "stacked", "bf16", "fsdp=16,ep=2", "tp=2"),  # 8-way FSDP x 2 EP > 8 experts: shards dim 1
    ("tiny-glm", "stacked", "bf16", "fsdp=2,replicas=2", "dp=2,ep"),
    ("tiny-llama", "hf", "bf16", "fsdp=3", "tp=2,dp=2"),
]


@pytest.mark.parametrize("model,fmt,dtype,trainer,inference", CASES)
def test_sharded_plan_matches_vllm_on_every_rank(plan_cache, model, fmt, dtype, trainer, inference):
    verified_plan(plan_cache, model, fmt, dtype, trainer, inference)


def test_dp_attention_weights_are_recorded_once(plan_cache):
    plan = load_plan(plan_cache("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep"))
    attention = [e for e in plan.dests if ".self_attn." in e.name]
    experts = [e for e in plan.dests if e.name.endswith("w13_weight")]
    assert attention and all(e.ranks == (0, 1, 2, 3) for e in attention)
    assert experts and all(len(e.ranks) == 1 for e in experts)
    assert len({e.name for e in plan.dests}) < sum(len(e.ranks) for e in plan.dests)


def test_replicas_balance_the_bytes_served(plan_cache):
    summary = summarize(load_plan(plan_cache("tiny-glm", "stacked", "bf16", "fsdp=2,replicas=2", "dp=2,ep")))
    assert summary["src_ranks"] == 4
    assert min(summary["bytes_per_src_rank"]) > 0
    assert summary["src_balance"] <= 1.001  # split among the replicas by max-flow (passes/source_flow.py); greedy gave 1.00005
    choice = summary["source_choice"]  # recorded in the header's stats
    assert choice["method"] == "flow" and choice["greedy_max"] > choice["chosen_max"] == max(summary["bytes_per_src_rank"])


def test_every_trainer_rank_reads_only_its_shard(plan_cache):
    plan = load_plan(plan_cache("tiny-glm", "hf", "bf16", "fsdp=3", "tp=2"))
    runs = plan.runs
    for i in range(plan.n_runs):
        local = plan.local_shape(runs["src"][i], runs["src_rank"][i])
        assert runs["src_off"][i] + runs["length"][i] <= int(np.prod(local))


@pytest.mark.parametrize("trainer,inference,message", [
    ("fsdp=4", "tp=3", "tp=3 does not divide num_attention_heads=4"),
    ("fsdp=4", "dp=3,ep", "ep over 3 ranks does not divide the 8 routed experts"),
    ("fsdp=4", "tp=2,pp=6", "pp=6 is more than the model's 5 hidden layers"),
    ("fsdp=4,ep=3", "tp=1", "ep=3 must divide fsdp=4"),
    ("fsdp=0", "tp=1", "bad --trainer item 'fsdp=0'"),
    ("fsdp=4", "tp=two", "bad --inference item 'tp=two'"),
])
def test_impossible_layouts_are_refused_before_tracing(tmp_path, trainer, inference, message):
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match=message):
        compile_plan(CompileOptions(str(config_dir("tiny-glm")), "stacked", output=out, trainer=trainer, inference=inference))
    assert not out.exists()


def test_trainer_ep_needs_stacked_experts(tmp_path):
    with pytest.raises(ModelConfigError, match="trainer ep needs --trainer-format transformers"):
        compile_plan(CompileOptions(str(config_dir("tiny-glm")), "hf", output=tmp_path / "p.plan", trainer="fsdp=4,ep=2"))


# One model per TP rank, re-pointed per DP rank (compiler/frontend/rank_models.py): the plan must
# be byte-identical to building every rank for real, and a wrong re-pointing must be caught.

SHARED_CASES = [
    ("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep"),  # EP: local experts move with the DP rank
    ("tiny-qwen3-moe", "stacked", "fp32", "fsdp=4,ep=2", "dp=4,ep"),
    ("tiny-llama", "hf", "bf16", "fsdp=3", "tp=2,dp=2"),  # no MoE: DP ranks of one TP rank share a model
]


def _compile_with(tmp_path, monkeypatch, tracer, case, name):
    from weightplan.compiler import compile as compile_module

    monkeypatch.setattr(compile_module, "RankTracer", tracer)
    model, fmt, dtype, trainer, inference = case
    out = tmp_path / name
    result = compile_plan(CompileOptions(str(config_dir(model)), fmt, dtype, "none", out, trainer=trainer, inference=inference))
    monkeypatch.undo()
    return out.read_bytes(), result.stats


@pytest.mark.parametrize("case", SHARED_CASES)
def test_shared_models_give_the_plan_of_real_builds(plan_cache, tmp_path, monkeypatch, case):
    import functools

    from weightplan.compiler.frontend.rank_models import RankTracer

    shared = plan_cache(*case).read_bytes()
    real, stats = _compile_with(tmp_path, monkeypatch, functools.partial(RankTracer, share=False), case, "real.plan")
    assert stats["models_built"] == 4 and stats["guard"] == "off"
    assert shared == real


def test_shared_model_stats_say_what_was_shared(tmp_path):
    result = compile_plan(CompileOptions(str(config_dir("tiny-glm")), "stacked", "bf16", "none", tmp_path / "p.plan",
                                         trainer="fsdp=4,ep=2", inference="dp=4,ep"))
    # rank 0 built for real; ranks 1 and 2 traced on it re-pointed; rank 3 (the guard) traced both
    # ways, and its plan comes from the real build
    assert result.stats["models_built"] == 2
    assert result.stats["ranks_repointed"] == 2
    assert result.stats["guard"] == "passed (rank 3)"


def test_guard_catches_a_model_that_was_not_re_pointed(plan_cache, tmp_path, monkeypatch):
    from weightplan.compiler.frontend import rank_models

    case = SHARED_CASES[0]
    monkeypatch.setattr(rank_models, "place_experts", lambda *args, **kwargs: 0)  # "re-points" nothing
    plan, stats = _compile_with(tmp_path, monkeypatch, rank_models.RankTracer, case, "guarded.plan")
    assert stats["guard"].startswith("failed (rank 3)")
    assert stats["models_built"] == 4
    assert plan == plan_cache(*case).read_bytes()


def test_place_experts_gives_the_expert_map_of_a_real_build():
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config, place_experts

    cfg = config_dir("tiny-glm")
    base, config = make_vllm_config(cfg), make_vllm_config(cfg, dp=4, ep=True)

    def maps(model):
        return {name: (m.local_num_experts, m._expert_map.tolist()) for name, m in model.named_modules() if hasattr(m, "_expert_map")}

    model = build_model(config, dp_rank=0, base_config=base)
    assert place_experts(model, config, 0, 0) == 0  # its own rank: nothing moves
    moved = place_experts(model, config, 0, 2)
    real = build_model(config, dp_rank=2, base_config=base)
    assert moved == len(maps(real)) > 0
    assert maps(model) == maps(real)
    assert all(v[1].count(-1) == 6 for v in maps(real).values())  # 2 of the 8 experts are local


TP_DERIVED_CASES = [  # (case, what the guard must say)
    (("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "tp=4"), "passed"),  # every routed expert TP-sliced
    (("tiny-glm", "stacked", "bf16", "fsdp=2", "tp=4,pp=2"), "passed"),  # each pipeline stage derives its own
    (("tiny-llama", "hf", "bf16", "fsdp=3", "tp=4"), "failed"),  # 2 KV heads for 4 ranks: rank r reads head r // 2
]


@pytest.mark.parametrize("case,guard", TP_DERIVED_CASES)
def test_derived_tp_ranks_give_the_plan_of_real_builds(plan_cache, tmp_path, monkeypatch, case, guard):
    import functools

    from weightplan.compiler.frontend.rank_models import RankTracer

    real, real_stats = _compile_with(tmp_path, monkeypatch, functools.partial(RankTracer, derive_tp=False), case, "real.plan")
    derived_stats = compile_plan(CompileOptions(str(config_dir(case[0])), case[1], case[2], "none", tmp_path / "derived.plan",
                                                trainer=case[3], inference=case[4])).stats
    assert real_stats["tp_guard"] == "off" and real_stats["tp_ranks_derived"] == 0
    assert derived_stats["tp_guard"].startswith(guard), derived_stats["tp_guard"]
    stages = 2 if "pp=2" in case[4] else 1
    if guard == "passed":  # TP ranks 0, 1 and 3 of each stage built and traced, rank 2 derived
        assert derived_stats["tp_ranks_derived"] == stages and derived_stats["models_built"] == 3 * stages
    else:  # rank 3 (the guard) is not what ranks 0 and 1 predict: every rank built for real
        assert derived_stats["tp_ranks_derived"] == 0 and derived_stats["models_built"] == 4 * stages
    assert (tmp_path / "derived.plan").read_bytes() == real
