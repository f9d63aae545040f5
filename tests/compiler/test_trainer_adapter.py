"""--trainer-adapter: a trainer that is not a transformers model (torchtitan's DeepSeek-V3), traced and verified against vLLM."""

from __future__ import annotations

import pytest

from tests.conftest import config_dir
from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError, UnsupportedOpError
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

TORCHTITAN = "weightplan.compiler.trainer_adapters.torchtitan:TorchtitanDeepSeekV3"


@pytest.mark.parametrize("trainer, inference", [("fsdp=1", "tp=1"), ("fsdp=2,ep=2", "dp=2,ep")])
def test_torchtitan_deepseek_v3_plans_equal_vllm_loading(trainer, inference, tmp_path):
    out = tmp_path / "titan.plan"
    result = compile_plan(CompileOptions(str(config_dir("tiny-deepseek-v3")), output=out, trainer_adapter=TORCHTITAN,
                                         trainer=trainer, inference=inference))
    assert result.stats["dst_coverage"] == 1.0
    plan = load_plan(out)
    assert plan.header.trainer.format == "adapter" and plan.header.trainer.adapter == TORCHTITAN
    names = {e.name for e in plan.sources}
    assert "layers.1.moe.routed_experts.inner_experts.w1_EFD" in names  # torchtitan's own stacked experts
    result = verify_plan(out, model=str(config_dir("tiny-deepseek-v3")), seed=3)
    assert result.mismatches == () and result.tensors > 0


def test_a_renaming_transposing_adapter_verifies(tmp_path):
    out = tmp_path / "toy.plan"
    compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out,
                                trainer_adapter="tests.support.toy_trainer:Renamed"))
    assert verify_plan(out, model=str(config_dir("tiny-llama")), seed=1).mismatches == ()


@pytest.mark.parametrize("spec, message", [
    ("no_colon", r"give module:callable"),
    ("a:b:c", r"give module:callable"),
    ("tests.support.missing_trainer:X", r"cannot import tests\.support\.missing_trainer"),
    ("tests.support.toy_trainer:nothing", r"tests\.support\.toy_trainer has no callable nothing"),
    ("tests.support.toy_trainer:not_callable", r"has no callable not_callable"),
    ("tests.support.toy_trainer:raising", r"building the adapter .* failed: RuntimeError: no such model"),
    ("tests.support.toy_trainer:NoToHf", r"the adapter has no to_hf"),
    ("tests.support.toy_trainer:ReturnsList", r"to_hf returned list, not a dict"),
])
def test_bad_adapters_are_refused_in_one_line(spec, message, tmp_path):
    out = tmp_path / "bad.plan"
    with pytest.raises(ModelConfigError, match=message):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer_adapter=spec))
    assert not out.exists()


def test_an_adapter_computing_on_values_is_refused_naming_the_op(tmp_path):
    with pytest.raises(UnsupportedOpError, match=r"unsupported op aten\.mul"):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=tmp_path / "p.plan",
                                    trainer_adapter="tests.support.toy_trainer:Computing"))


def test_format_and_adapter_together_are_refused(tmp_path):
    with pytest.raises(ModelConfigError, match="either --trainer-format or --trainer-adapter"):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), "transformers", output=tmp_path / "p.plan",
                                    trainer_adapter=TORCHTITAN))
