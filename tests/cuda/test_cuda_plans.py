"""Plans traced on vLLM's CUDA build (device pinned, no GPU) equal vLLM's own load_weights on that build, byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weightplan.runtime import load_plan

from ..conftest import config_dir
from .conftest import DEVICE

MODELS = {  # config -> the attention backend vLLM's CUDA platform picks for it on sm90
    "tiny-llama": "FLASH_ATTN",
    "tiny-qwen3-moe": "FLASH_ATTN",
    "cuda-deepseek-v3": "FLASH_ATTN_MLA",  # DeepSeek's MLA dimensions: 16/16/16 finds no MLA prefill backend on CUDA
}
LAYOUTS = ("tp=2", "dp=2,ep")  # a dense model's dp=2 (expert parallelism needs experts)
ENV = "VLLM_DISABLE_SHARED_EXPERTS_STREAM=1 VLLM_USE_DEEP_GEMM=0"


def _compiled(plan_cache, model: str, layout: str, quant: str):
    """The plan of `model` for `layout` and `quant`, and the --moe-backend it was compiled with: on sm90 vLLM picks
    FlashInfer CUTLASS for block-fp8 MoE under expert parallelism (its w13 in [w3, w1] order), so those plans ask for
    Triton, as their engines must."""
    inference = "dp=2" if model == "tiny-llama" and layout == "dp=2,ep" else layout
    moe_backend = "triton" if quant != "none" and model != "tiny-llama" and "ep" in layout else None
    return plan_cache(model, inference=inference, quant=quant, moe_backend=moe_backend), moe_backend


@pytest.mark.parametrize("quant", ("none", "fp8_per_block"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_cuda_plans_verify_against_vllms_own_load_on_the_cuda_build(plan_cache, model, layout, quant):
    from weightplan.compiler.verify_plan import verify_plan

    path, moe_backend = _compiled(plan_cache, model, layout, quant)
    header = load_plan(path).header
    assert header.inference.platform == "cuda"
    expected = {"device": DEVICE, "device_name": "NVIDIA H200", "capability": "9.0", "attention_backend": MODELS[model],
                "env": ENV}
    if model != "tiny-llama":
        expected["moe_backend"] = "TRITON"
    if moe_backend is not None:
        expected["moe_backend_setting"] = moe_backend
    assert header.inference.vllm_host == expected
    if quant == "none":
        assert header.quant_layout is None
    else:  # the kernels vLLM's CUDA build chose on sm90, both keeping per_block_cast_to_fp8's plain layout
        layout_ = header.quant_layout
        assert (layout_.linear, layout_.moe, layout_.layout) == (
            "CutlassFp8BlockScaledMMKernel", "TRITON" if model != "tiny-llama" else "none", "plain")
        assert layout_.scale_rounding.value == "cuda"
    result = verify_plan(path, model=str(config_dir(model)))
    assert result.mismatches == ()
    ranks = {name.rsplit("(inference rank ", 1)[1] for name in result.compared}
    assert ranks == {"0)", "1)"} and result.tensors == len(result.compared) > 0


def test_an_fp8_moe_plan_under_expert_parallelism_with_vllms_own_choice_is_refused_naming_the_backend(tmp_path):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.cuda_platform import CudaTraceUnavailable

    out = tmp_path / "refused.plan"
    with pytest.raises(CudaTraceUnavailable) as refused:
        compile_plan(CompileOptions(str(config_dir("cuda-deepseek-v3")), quant="fp8_per_block", inference="dp=2,ep",
                                    output=out))
    assert str(refused.value).startswith("vLLM chose the FLASHINFER_CUTLASS MoE backend for DeepseekV3ForCausalLM on h200; ")
    assert "--moe-backend triton" in str(refused.value) and "\n" not in str(refused.value)
    assert not out.exists()


def test_an_unknown_moe_backend_is_refused_in_one_line(tmp_path):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.cuda_platform import CudaTraceUnavailable

    with pytest.raises(CudaTraceUnavailable, match=r"^unknown --moe-backend 'tritn'; vLLM 0\.33\.\d+ knows auto, triton, "):
        compile_plan(CompileOptions(str(config_dir("tiny-qwen3-moe")), moe_backend="tritn", output=tmp_path / "x.plan"))


def test_the_pinned_platform_is_vllms_cuda_platform_with_the_profiles_device():
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import CudaPlatformBase

    assert isinstance(current_platform, CudaPlatformBase) and current_platform.is_cuda()
    assert current_platform.get_device_capability() == (9, 0)
    assert current_platform.get_device_name() == "NVIDIA H200"
    assert current_platform.device_count() == 8 and current_platform.is_fully_connected([0, 1])
    assert current_platform.is_arch_support_pdl() and current_platform.num_compute_units() == 132
    assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1" and os.environ["VLLM_USE_DEEP_GEMM"] == "0"


def test_pinning_another_device_in_the_same_process_is_refused():
    from weightplan.compiler.frontend.cuda_platform import CudaTraceUnavailable, trace_cuda

    with pytest.raises(CudaTraceUnavailable) as refused:
        trace_cuda("b200")
    assert str(refused.value) == ("vLLM chose its platform (PinnedCudaPlatform h200) before the CUDA device b200 was "
                                  "pinned: pin it first, once per process")


def test_a_b200_plan_records_capability_10_and_verifies_from_the_command_line(tmp_path, plan_cache):
    out = tmp_path / "llama-b200.plan"
    bin_dir = os.path.dirname(sys.executable)
    compiled = subprocess.run([f"{bin_dir}/compile-plan", "--model", str(config_dir("tiny-llama")), "--inference", "tp=2",
                               "--platform", "cuda", "--device", "b200", "-o", str(out)],
                              capture_output=True, text=True, timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    header = load_plan(out).header
    assert header.inference.vllm_host["capability"] == "10.0" and header.inference.vllm_host["device"] == "b200"
    h200 = load_plan(plan_cache("tiny-llama", inference="tp=2")).header
    assert header.fingerprint != h200.fingerprint and header.dests == h200.dests
    verified = subprocess.run([f"{bin_dir}/verify-plan", str(out), "--model", str(config_dir("tiny-llama"))],
                              capture_output=True, text=True, timeout=600)
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert verified.stdout.startswith("verified: 42 tensors, ")


def test_b200_moe_plans_with_the_triton_backend_verify_and_vllms_own_choice_is_refused(tmp_path):
    """On sm100 vLLM picks FlashInfer TRT-LLM for MoE (it pads and shuffles the experts after loading), bf16 or fp8;
    with --moe-backend triton both plans keep the loader's layout and verify."""
    bin_dir = os.path.dirname(sys.executable)
    model = str(config_dir("tiny-qwen3-moe"))

    def compile_plan(out, *extra):
        return subprocess.run([f"{bin_dir}/compile-plan", "--model", model, "--inference", "dp=2,ep", "--platform", "cuda",
                               "--device", "b200", "--quant", "fp8_per_block", "-o", str(out), *extra],
                              capture_output=True, text=True, timeout=600)

    refused = compile_plan(tmp_path / "auto.plan")
    assert refused.returncode != 0 and not (tmp_path / "auto.plan").exists()
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "error: vLLM chose the FLASHINFER_TRTLLM MoE backend for Qwen3MoeForCausalLM on b200; ")
    out = tmp_path / "triton.plan"
    compiled = compile_plan(out, "--moe-backend", "triton")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    header = load_plan(out).header
    assert header.inference.vllm_host["capability"] == "10.0" and header.inference.vllm_host["moe_backend"] == "TRITON"
    assert header.quant_layout.moe == "TRITON"
    verified = subprocess.run([f"{bin_dir}/verify-plan", str(out), "--model", model], capture_output=True, text=True,
                              timeout=600)
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert verified.stdout.startswith("verified: ") and "identical to vLLM" in verified.stdout
