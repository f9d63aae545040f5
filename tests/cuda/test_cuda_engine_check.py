"""The engine check on a CUDA engine (faked: vLLM's CUDA platform pinned, no GPU): same platform and capability accepted,
a cpu plan or another capability's refused in one line naming the difference."""

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
                        "env VLLM_DISABLE_SHARED_EXPERTS_STREAM=1")
