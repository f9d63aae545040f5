"""Bad input gets a clear error naming what is wrong, and changes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import (
    DataDependentError,
    DestinationError,
    ModelConfigError,
    UnsupportedOpError,
)
from weightplan.compiler.frontend.lazy_weight import LazyWeight, WriteRecorder, tracing
from weightplan.compiler.models import resolve_model
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import PlanMismatchError, execute_local, load_plan

from ..conftest import config_dir


def test_unknown_model_lists_known_ones():
    with pytest.raises(ModelConfigError, match=r"unknown model 'glm-9'.*Known models: glm-5.2"):
        resolve_model("glm-9")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelConfigError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_config_vllm_cannot_build_names_the_field(tmp_path):
    bad = json.loads((config_dir("tiny-llama") / "config.json").read_text())
    bad["num_attention_heads"] = 5  # 64 is not a multiple of 5
    (tmp_path / "config.json").write_text(json.dumps(bad))
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match="number of attention heads"):
        compile_plan(CompileOptions(str(tmp_path), output=out))
    assert not out.exists()


@pytest.mark.parametrize("field,value,message", [
    ("trainer_format", "fsdp", "unknown --trainer-format 'fsdp'"),
    ("trainer_dtype", "fp8", "unknown --trainer-dtype 'fp8'"),
    ("quant", "int4", "unknown --quant 'int4'"),
])
def test_bad_compile_options(tmp_path, field, value, message):
    options = CompileOptions(str(config_dir("tiny-llama")), output=tmp_path / "p.plan", **{field: value})
    with pytest.raises(ModelConfigError, match=message):
        compile_plan(options)
    assert not (tmp_path / "p.plan").exists()


def _lazy(name="model.w", shape=(4, 6), dtype=torch.float32):
    return LazyWeight.source(name, shape, dtype)


def test_unsupported_op_names_op_argument_types_and_tensor():
    tracer = WriteRecorder({"p": torch.empty(4, 6, device="meta")})
    tracer.loading = "model.layers.0.mlp.up_proj.weight"
    with tracing(tracer):
        with pytest.raises(UnsupportedOpError) as info:
            torch.abs(_lazy())
    message = str(info.value)
    assert "aten.abs.default" in message
    assert "LazyWeight[torch.float32,(4, 6)]" in message
    assert "model.layers.0.mlp.up_proj.weight" in message


@pytest.mark.parametrize("call", [
    lambda t: t.sum().item(),
    lambda t: t[0, 0].item(),
    lambda t: bool(t[0, 0]),
    lambda t: t.tolist(),
    lambda t: t.data_ptr(),
    lambda t: t.numpy(),
])
def test_data_dependent_calls_are_refused(call):
    tracer = WriteRecorder({})
    tracer.loading = "model.norm.weight"
    with tracing(tracer):
        with pytest.raises((DataDependentError, UnsupportedOpError), match="model.norm.weight"):
            call(_lazy())


def test_copy_into_a_non_parameter_is_refused():
    tracer = WriteRecorder({"p": torch.empty(4, 6, device="meta")})
    with tracing(tracer):
        with pytest.raises(DestinationError, match="not a model parameter"):
            torch.empty(4, 6, device="meta").copy_(_lazy())


def _tensors(plan, rank_specs):
    return {e.name: torch.zeros(e.shape, dtype=getattr(torch, e.dtype)) for e in rank_specs}


@pytest.mark.parametrize("damage,message", [
    ("missing", "trainer rank 0 tensors missing: model.embed_tokens.weight"),
    ("extra", "tensors not in the plan: model.extra.weight"),
    ("shape", r"'model.norm.weight' is bfloat16\[65\], the plan expects bfloat16\[64\]"),
    ("dtype", r"'model.norm.weight' is float32\[64\], the plan expects bfloat16\[64\]"),
])
def test_wrong_trainer_tensors_are_refused_before_any_write(plan_cache, damage, message):
    plan = load_plan(plan_cache("tiny-llama"))
    sources = _tensors(plan, plan.sources)
    if damage == "missing":
        del sources["model.embed_tokens.weight"]
    elif damage == "extra":
        sources["model.extra.weight"] = torch.zeros(3)
    elif damage == "shape":
        sources["model.norm.weight"] = torch.zeros(65, dtype=torch.bfloat16)
    else:
        sources["model.norm.weight"] = torch.zeros(64)
    dests = {e.name: torch.full(e.shape, 7.0, dtype=getattr(torch, e.dtype)) for e in plan.dests}
    with pytest.raises(PlanMismatchError, match=message):
        execute_local(plan, {0: sources}, {0: dests})
    assert all(bool((t == 7).all()) for t in dests.values()), "a refused plan must not write"


def test_wrong_destination_is_refused(plan_cache):
    plan = load_plan(plan_cache("tiny-llama"))
    dests = _tensors(plan, plan.dests)
    dests["lm_head.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(PlanMismatchError, match="lm_head.weight"):
        execute_local(plan, {0: _tensors(plan, plan.sources)}, {0: dests})


def test_verify_refuses_a_plan_for_another_config(plan_cache, tmp_path):
    shutil.copytree(config_dir("tiny-llama"), tmp_path / "cfg")
    config = json.loads((tmp_path / "cfg" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanMismatchError, match="model config .* differs"):
        verify_plan(plan_cache("tiny-llama"), model=str(tmp_path / "cfg"))


@pytest.mark.parametrize("ranks,message", [([0, 7], r"inference ranks \[7\] are not among the plan's 1 ranks \(0..0\)"),
                                           ([], r"no inference rank to verify: pick some of 0..0")])
def test_verify_refuses_inference_ranks_the_plan_does_not_have(plan_cache, ranks, message):
    with pytest.raises(PlanMismatchError, match=message):
        verify_plan(plan_cache("tiny-llama"), model=str(config_dir("tiny-llama")), ranks=ranks)


def test_verify_refuses_a_plan_for_another_vllm(plan_cache, tmp_path):
    from weightplan.runtime.plan.format import write_plan
    from weightplan.runtime.plan.schema import RUN_COLUMNS

    plan = load_plan(plan_cache("tiny-llama"))
    header = dataclasses.replace(plan.header, vllm_version="0.1.0")
    other = write_plan(tmp_path / "old.plan", header, {c: plan.table[c] for c in RUN_COLUMNS})
    with pytest.raises(PlanMismatchError, match="vLLM version: plan 0.1.0, installed 0.32.0"):
        verify_plan(other, model=str(config_dir("tiny-llama")))
