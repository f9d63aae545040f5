"""Under vLLM 0.26 and 0.30: every architecture of tests/configs its CPU platform builds compiles and verifies; 0.26's
refuses MLA in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from . import ONLY_UNDER_0_26, ONLY_UNDER_0_30, UNDER_A_COMPAT_VLLM, VLLM
from ..conftest import config_dir, with_header_edit

pytestmark = UNDER_A_COMPAT_VLLM

# (model, quant, trainer, inference): dense, MoE, tied embeddings; bf16 and fp8. Not tiny-hunyuan-moe: vLLM 0.26's own
# HunYuanMoEV1 class reads `moe_intermediate_size`, which its transformers (5.25) config lacks (vLLM 0.32 serves the
# architecture through its Transformers backend), so vLLM 0.26 cannot build it here.
CASES = [
    ("tiny-llama", "none", "fsdp=1", "tp=1"),
    ("tiny-llama", "fp8_per_block", "fsdp=1", "tp=1"),
    ("tiny-llama", "none", "fsdp=2", "tp=2"),
    ("tiny-qwen3-moe", "none", "fsdp=1", "tp=1"),
    ("tiny-qwen3-moe", "fp8_per_block", "fsdp=1", "tp=1"),
    ("tiny-qwen3-moe", "none", "fsdp=2", "tp=2"),
    ("tiny-qwen3-moe", "none", "fsdp=2", "dp=2,ep"),
    ("tiny-qwen3-moe", "fp8_per_block", "fsdp=2", "dp=2,ep"),
    ("vocab-llama-tied", "none", "fsdp=1", "tp=2"),
]
MLA_MODELS = ("tiny-deepseek-v3", "tiny-glm")
# vLLM 0.30 builds MLA on CPU (its CPU_MLA backend, GLM's sparse attention built dense: dense_mla_backend).
MLA_CASES = [
    ("tiny-glm", "none", "fsdp=1", "tp=1"),
    ("tiny-deepseek-v3", "none", "fsdp=1", "tp=1"),
    ("tiny-deepseek-v3", "none", "fsdp=2", "dp=2,ep"),
    ("fp8-deepseek-v3", "fp8_per_block", "fsdp=1", "tp=1"),
]


@pytest.mark.parametrize("model,quant,trainer,inference",
                         [*CASES, *(pytest.param(*c, marks=ONLY_UNDER_0_30) for c in MLA_CASES)],
                         ids=["-".join(c) for c in CASES + MLA_CASES])
def test_plans_compiled_under_this_vllm_verify_against_its_own_loading(plan_cache, model, quant, trainer, inference):
    from weightplan.compiler.verify_plan import verify_plan
    from weightplan.runtime import load_plan

    path = plan_cache(model, "hf", "bf16", trainer, inference, quant)
    plan = load_plan(path)
    assert plan.header.vllm_version == VLLM
    result = verify_plan(path, model=str(config_dir(model)), seed=1)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests) > 0


@ONLY_UNDER_0_26
@pytest.mark.parametrize("model", MLA_MODELS)
def test_mla_models_are_refused_in_one_line_naming_the_version(tmp_path, model):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.vllm_patches import UnsupportedVllm

    with pytest.raises(UnsupportedVllm) as refused:
        compile_plan(CompileOptions(str(config_dir(model)), output=tmp_path / "p.plan"))
    message = str(refused.value)
    assert "\n" not in message and f"vLLM {VLLM}'s CPU platform cannot build (no CPU MLA backend)" in message
    assert message.startswith("DeepseekV3ForCausalLM uses MLA attention" if model == "tiny-deepseek-v3" else "Glm")


@ONLY_UNDER_0_26
def test_compile_plan_refuses_an_mla_model_in_one_line_without_a_traceback(tmp_path):
    done = subprocess.run([str(Path(sys.executable).parent / "compile-plan"), "--model", str(config_dir("tiny-glm")),
                           "--output", str(tmp_path / "p.plan")], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "uses MLA attention" in lines[0] and VLLM in lines[0], done.stderr[-2000:]


def test_verify_plan_refuses_a_plan_traced_by_another_vllm(plan_cache, tmp_path):
    from weightplan.compiler.verify_plan import verify_plan
    from weightplan.runtime import PlanMismatchError
    from weightplan.runtime.errors import WeightplanError

    other = tmp_path / "other.plan"
    other.write_bytes(with_header_edit(plan_cache("tiny-llama").read_bytes(),
                                       lambda header: header.update(vllm_version="0.32.0")))
    with pytest.raises((PlanMismatchError, WeightplanError)) as refused:
        verify_plan(other, model=str(config_dir("tiny-llama")))
    assert "\n" not in str(refused.value) and f"vLLM version: plan 0.32.0, installed {VLLM}" in str(refused.value)

