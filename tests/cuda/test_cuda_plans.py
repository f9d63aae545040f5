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


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_cuda_plans_verify_against_vllms_own_load_on_the_cuda_build(plan_cache, model, layout):
    inference = "dp=2" if model == "tiny-llama" and layout == "dp=2,ep" else layout
    from weightplan.compiler.verify_plan import verify_plan

    path = plan_cache(model, inference=inference)
    header = load_plan(path).header
    assert header.inference.platform == "cuda"
    assert header.inference.vllm_host == {
        "device": DEVICE, "device_name": "NVIDIA H200", "capability": "9.0", "attention_backend": MODELS[model],
        "env": "VLLM_DISABLE_SHARED_EXPERTS_STREAM=1"}
    result = verify_plan(path, model=str(config_dir(model)))
    assert result.mismatches == ()
    ranks = {name.rsplit("(inference rank ", 1)[1] for name in result.compared}
    assert ranks == {"0)", "1)"} and result.tensors == len(result.compared) > 0


def test_the_pinned_platform_is_vllms_cuda_platform_with_the_profiles_device():
    from vllm.platforms import current_platform
    from vllm.platforms.cuda import CudaPlatformBase

    assert isinstance(current_platform, CudaPlatformBase) and current_platform.is_cuda()
    assert current_platform.get_device_capability() == (9, 0)
    assert current_platform.get_device_name() == "NVIDIA H200"
    assert current_platform.device_count() == 8 and current_platform.is_fully_connected([0, 1])
    assert current_platform.is_arch_support_pdl() and current_platform.num_compute_units() == 132
    assert os.environ["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] == "1"


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
