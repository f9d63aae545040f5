"""A vLLM worker's plan rank at pipeline_parallel_size > 1 (vllm_backend/engine_check.py): the rank groups vLLM's own
`initialize_model_parallel` builds (captured without processes) give each worker the plan rank vLLM numbers it with, and
a plan for another pp is refused in one line."""

from __future__ import annotations

import dataclasses

from types import SimpleNamespace

import pytest
import torch

from weightplan.runtime import PlanMismatchError
from weightplan.runtime.plan.header import EplbHeader, InferenceHeader, RankCoords
from weightplan.vllm_backend.engine_check import check_engine, plan_rank


def _vllm_groups(monkeypatch, dp: int, pp: int, tp: int) -> dict[str, list[list[int]]]:
    """The rank lists of every group vLLM's initialize_model_parallel creates for a dp x pp x tp world."""
    import vllm.config
    from vllm.distributed import parallel_state as ps

    groups: dict[str, list[list[int]]] = {}

    def record(group_ranks, local_rank, backend, *, group_name, **kwargs):
        groups[group_name] = [list(r) for r in group_ranks]
        return SimpleNamespace(rank_in_group=0)

    for name in ("_TP", "_ETP", "_ENGRAM_DP", "_DCP", "_PCP", "_PP", "_DP", "_EP", "_EPLB"):
        if hasattr(ps, name):
            monkeypatch.setattr(ps, name, None)
    monkeypatch.setattr(ps, "init_model_parallel_group", record)
    monkeypatch.setattr(ps, "get_world_group", lambda: SimpleNamespace(local_rank=0, device_group=None))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: dp * pp * tp)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    parallel = SimpleNamespace(data_parallel_size=dp, enable_elastic_ep=False, use_all2all=False, enable_eplb=False)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config",
                        lambda: SimpleNamespace(parallel_config=parallel, engram_config=None, model_config=None))
    ps.initialize_model_parallel(tp, pp, backend="gloo")
    return groups


@pytest.mark.parametrize("dp, pp, tp", [(1, 2, 1), (1, 2, 2), (2, 2, 2), (1, 3, 2), (2, 4, 1), (3, 2, 4)])
def test_plan_rank_is_vllms_global_worker_index(monkeypatch, dp, pp, tp):
    from vllm.config import ParallelConfig

    groups = _vllm_groups(monkeypatch, dp, pp, tp)

    def rank_in(kind: str, rank: int) -> int:
        return next(ranks.index(rank) for ranks in groups[kind] if rank in ranks)

    for worker in range(dp * pp * tp):
        tp_rank, pp_rank, dp_rank = rank_in("tp", worker), rank_in("pp", worker), rank_in("dp", worker)
        config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                                data_parallel_rank=dp_rank)
        assert plan_rank(config, tp_rank, pp_rank, 0) == worker
        assert plan_rank(config, tp_rank, pp_rank, 5) == worker + 5  # a rank_offset shifts it
        assert RankCoords.of(worker, tp, pp) == RankCoords(tp_rank, pp_rank, dp_rank)


def _header(pp: int | None) -> SimpleNamespace:
    import vllm

    inference = InferenceHeader("tp1", 1, 1, False, "cpu", pp=pp)
    return SimpleNamespace(architecture="LlamaForCausalLM", inference=inference, dst_ranks=inference.ranks,
                           vllm_version=vllm.__version__, model="tiny-llama", fingerprint="0" * 64)


@pytest.mark.parametrize("plan_pp, engine_pp", [(None, 2), (2, 1), (2, 4)])
def test_a_plan_for_another_pipeline_size_is_refused_in_one_line(plan_pp, engine_pp):
    from vllm.config import ParallelConfig

    plan = SimpleNamespace(header=_header(plan_pp), dests=())
    vllm_config = SimpleNamespace(parallel_config=ParallelConfig(pipeline_parallel_size=engine_pp),
                                  model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                                                               model="tiny-llama"))
    with pytest.raises(PlanMismatchError, match=rf"pipeline parallel size: plan pp={plan_pp or 1}, engine "
                                                rf"pipeline_parallel_size={engine_pp}; compile the plan with --inference "
                                                rf"\.\.\.,pp={engine_pp}") as caught:
        check_engine(plan, 0, torch.nn.Module(), vllm_config, "cpu")
    assert "\n" not in str(caught.value)
    same = SimpleNamespace(header=_header(engine_pp if engine_pp > 1 else None), dests=())
    assert check_engine(same, 0, torch.nn.Module(), vllm_config, "cpu") == []


def _eplb_engine(enabled: bool, redundant: int) -> SimpleNamespace:
    """A GPU engine's config as check_engine reads it (vLLM's CPU platform refuses enable_eplb itself)."""
    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                               data_parallel_index=0, enable_eplb=enabled,
                               eplb_config=SimpleNamespace(num_redundant_experts=redundant))
    return SimpleNamespace(parallel_config=parallel,
                           model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                                                        model="tiny-llama"))


def _eplb_plan(redundant: int | None) -> SimpleNamespace:
    header = _header(None)
    if redundant is not None:
        header.inference = dataclasses.replace(header.inference, eplb=EplbHeader(8, redundant, (("w13",),)))
    return SimpleNamespace(header=header, dests=())


@pytest.mark.parametrize("plan_redundant, engine, message", [
    (None, (True, 0), r": enable_eplb \(0 redundant experts\): vLLM's expert load balancer moves experts .* compiled "
                      r"without it; compile it with --inference \.\.\.,ep,eplb=0"),
    (2, (False, 0), r": the plan is for an engine with --enable-eplb and 2 redundant experts; this engine runs without"),
    (2, (True, 4), r": redundant experts: plan 2, engine 4 \(eplb_config.num_redundant_experts\)"),
])
def test_expert_load_balancing_must_agree_between_plan_and_engine(plan_redundant, engine, message):
    with pytest.raises(PlanMismatchError, match=message) as caught:
        check_engine(_eplb_plan(plan_redundant), 0, torch.nn.Module(), _eplb_engine(*engine), "cpu")
    assert "\n" not in str(caught.value)


def test_an_eplb_plan_fits_an_engine_with_its_redundant_experts():
    assert check_engine(_eplb_plan(2), 0, torch.nn.Module(), _eplb_engine(True, 2), "cpu") == []