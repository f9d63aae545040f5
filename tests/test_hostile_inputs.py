"""Careless and hostile inputs to the compiler and verify-plan: one clear error naming the option or field, before any tracing."""

from __future__ import annotations

import json

import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import PlanMismatchError

from .conftest import config_dir


@pytest.mark.parametrize("trainer,inference,message", [
    ("fsdp=1", "tp=²", r"bad --inference item 'tp=²'"),
    ("fsdp=1", "tp=1,tp=2", "--inference 'tp=1,tp=2' gives tp twice"),
    ("fsdp=2,fsdp=4", "tp=1", "--trainer 'fsdp=2,fsdp=4' gives fsdp twice"),
    ("", "tp=1", "--trainer is empty"),
    ("fsdp=1", " ", "--inference is empty"),
    ("fsdp=1", "dp=100000", r"bad --inference item 'dp=100000'.*1\.\.4096"),
    ("fsdp=1000000", "tp=1", r"bad --trainer item 'fsdp=1000000'"),
    ("fsdp=4096,replicas=2", "tp=1", "8192 ranks; plans support at most 4096"),
    ("fsdp=1", "tp=64,dp=128", "8192 ranks; plans support at most 4096"),
    ("fsdp=2,", "tp=1", "bad --trainer item ''"),
])
def test_layout_strings_are_refused_before_tracing(tmp_path, trainer, inference, message):
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match=message):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer=trainer, inference=inference))
    assert not out.exists()


def test_trainer_ep_beyond_the_expert_count_is_refused(tmp_path):
    experts = json.loads((config_dir("tiny-glm") / "config.json").read_text())["n_routed_experts"]
    with pytest.raises(ModelConfigError, match=f"--trainer ep={4 * experts} is more than the model's {experts} routed experts"):
        compile_plan(CompileOptions(str(config_dir("tiny-glm")), "stacked", output=tmp_path / "p.plan",
                                    trainer=f"fsdp={4 * experts},ep={4 * experts}"))


@pytest.mark.parametrize("content,message", [
    (b"[1, 2]", "holds a JSON list, expected an object"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b"{", "is not valid JSON"),
    (json.dumps({"num_attention_heads": "8"}).encode(), "field 'num_attention_heads' is '8', expected a non-negative integer"),
    (b"[" * 100000, "is not valid JSON"),
])
def test_malformed_config_json_names_the_file_and_field(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ModelConfigError, match=message) as info:
        compile_plan(CompileOptions(str(tmp_path), output=tmp_path / "p.plan"))
    assert str(tmp_path / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_verify_refuses_a_sample_with_nothing_to_compare(plan_cache):
    path = plan_cache("tiny-llama")
    with pytest.raises(PlanMismatchError, match="no destination tensor of at most 1 bytes to sample"):
        verify_plan(path, model=str(config_dir("tiny-llama")), sample=3, max_tensor_bytes=1)
