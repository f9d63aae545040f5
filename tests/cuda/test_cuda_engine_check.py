"""The engine check on a CUDA engine (faked: vLLM's CUDA platform pinned, no GPU): same platform, capability and kernels
accepted, a cpu plan, another capability's or another MoE backend's refused in one line naming the difference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from weightplan.runtime import PlanMismatchError, load_plan
from weightplan.runtime.plan.format import decode_plan
from weightplan.compiler.frontend.vllm_patches import HOST_PROFILE

from ..conftest import config_dir, with_header_edit


def _engine(tp: int = 2):
    """What _layout_problems reads of a tp=2 Llama engine."""
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                               data_parallel_index=0)
    model = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), model="tiny-llama")
    return SimpleNamespace(parallel_config=parallel, model_config=model)


@pytest.fixture(scope="module")
def cuda_plan(plan_cache):
    return plan_cache("tiny-llama", inference="tp=2")


def test_a_cuda_plan_of_the_engines_capability_is_accepted(cuda_plan):
    from weightplan.vllm_backend.engine_check import _layout_problems

    engine = _engine()
    plan = load_plan(cuda_plan)
    assert _layout_problems(plan, 0, engine, "cuda", engine.model_config, capability="9.0") == []
    assert _layout_problems(plan, 1, engine, "cuda", engine.model_config) == []  # the pinned H200 is the engine's GPU


def test_a_plan_of_another_capability_is_refused_naming_it(cuda_plan):
    from weightplan.vllm_backend.engine_check import _layout_problems

    engine = _engine()
    assert _layout_problems(load_plan(cuda_plan), 0, engine, "cuda", engine.model_config, capability="10.0") == [
        "device capability: plan 9.0 (h200), engine 10.0"]


def test_a_cpu_plan_is_refused_by_a_cuda_engine(cuda_plan):
    from weightplan.vllm_backend.engine_check import _layout_problems

    def as_cpu(header):
        header["inference"]["platform"] = "cpu"
        header["inference"]["vllm_host"] = dict(HOST_PROFILE)

    cpu_plan = decode_plan(with_header_edit(cuda_plan.read_bytes(), as_cpu))
    engine = _engine()
    assert _layout_problems(cpu_plan, 0, engine, "cuda", engine.model_config, capability="9.0") == [
        "platform: plan 'cpu', engine 'cuda'"]


def test_check_engine_refuses_in_one_line_on_a_live_model_of_another_capability(cuda_plan, monkeypatch):
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.vllm_backend import engine_check

    vllm_config = make_vllm_config(config_dir("tiny-llama"), tp=2)
    model = build_model(vllm_config, tp_rank=0)
    plan = load_plan(cuda_plan)
    held = engine_check.check_engine(plan, 0, model, vllm_config, "cuda")
    assert len(held) == len([e for e in plan.dests if 0 in e.ranks]) > 0
    monkeypatch.setattr(engine_check, "engine_capability", lambda: "10.0")
    with pytest.raises(PlanMismatchError) as refused:
        engine_check.check_engine(plan, 0, model, vllm_config, "cuda")
    message = str(refused.value)
    assert "\n" not in message and message.endswith(": device capability: plan 9.0 (h200), engine 10.0")
    assert message.startswith(f"plan 'tiny-llama' ({plan.header.fingerprint[:12]}) does not match this engine")


def test_inspect_plan_shows_the_platform_and_the_device_profile(cuda_plan, capsys):
    from weightplan.compiler.cli import inspect_main

    assert inspect_main([str(cuda_plan)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "  vllm           0.33.0 on cuda"
    assert lines[3] == ("  profile        attention_backend FLASH_ATTN; capability 9.0; device h200; device_name NVIDIA H200; "
                        "env VLLM_DISABLE_SHARED_EXPERTS_STREAM=1 VLLM_USE_DEEP_GEMM=0")


def test_an_engine_whose_moe_backend_differs_from_the_plans_is_refused_naming_the_setting(plan_cache, monkeypatch):
    """The plan was traced with --moe-backend triton; an engine that left it to vLLM (FlashInfer CUTLASS on sm90 under
    expert parallelism, its w13 in [w3, w1] order) holds the experts in another layout."""
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    from weightplan.compiler.frontend.fp8_trace import trace_post_load
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.vllm_backend import engine_check

    path = plan_cache("cuda-deepseek-v3", inference="dp=2,ep", quant="fp8_per_block", moe_backend="triton")
    plan = load_plan(path)
    engine = {"quantization": "fp8_per_block", "moe_backend": "triton"}
    vllm_config = make_vllm_config(config_dir("cuda-deepseek-v3"), dp=2, ep=True, **engine)
    model = build_model(vllm_config, dp_rank=1, base_config=make_vllm_config(config_dir("cuda-deepseek-v3"), **engine))
    trace_post_load(model)  # what the engine holds after loading: fp8 weights and block scales (on meta here)
    assert engine_check.check_engine(plan, 1, model, vllm_config, "cuda")
    for module in model.modules():
        if getattr(getattr(module, "quant_method", None), "fp8_backend", None) is not None:
            monkeypatch.setattr(module.quant_method, "fp8_backend", Fp8MoeBackend.FLASHINFER_CUTLASS)
    with pytest.raises(PlanMismatchError) as refused:
        engine_check.check_engine(plan, 1, model, vllm_config, "cuda")
    message = str(refused.value)
    assert "\n" not in message and message.endswith(
        ": moe_backend: plan TRITON, engine FLASHINFER_CUTLASS (start the engine with --moe-backend triton, as the plan "
        "was traced; docs/cuda.md)")


def test_an_engine_with_expert_load_balancing_needs_an_eplb_plan(cuda_plan):
    """vLLM's own ParallelConfig with enable_eplb (the CUDA platform accepts it; the CPU platform refuses it), and a plan
    compiled without EPLB."""
    from vllm.config import ParallelConfig

    from weightplan.vllm_backend.engine_check import _layout_problems

    engine = _engine()
    engine.parallel_config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=1, enable_expert_parallel=True,
                                            enable_eplb=True, eplb_config={"num_redundant_experts": 2})
    problems = _layout_problems(load_plan(cuda_plan), 0, engine, "cuda", engine.model_config, capability="9.0")
    assert problems == ["enable_eplb (2 redundant experts): vLLM's expert load balancer moves experts between physical "
                        "slots while serving, and this plan was compiled without it; compile it with --inference "
                        "...,ep,eplb=2 (docs/vllm.md#expert-load-balancing-eplb)"]
