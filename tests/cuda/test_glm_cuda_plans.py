"""The checked-in GLM-5.2 plans for GPU engines (plans/glm-5.2/cuda-h200/) are what the compiler makes now, verify against
vLLM's CUDA build, and describe the cpu seed plans' parameters with the GPU engine's kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weightplan.compiler.make_plans import CHECKED_IN_CUDA
from weightplan.runtime import load_plan

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "glm_full_worker.py"
MAX_RSS_MB = 8 * 1024  # every full-size step in its own process, each under 8 GB (as tests/e2e/test_glm_full.py)


def run_worker(*args) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["peak_rss_mb"] < MAX_RSS_MB, f"{args[0]} {args[1]} peaked at {report['peak_rss_mb']:.0f} MB"
    return report


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("glm-cuda"), {}

    def compiled(index: int):
        if index not in done:
            path = root / f"{index}.plan"
            done[index] = (path, run_worker("compile-cuda", index, path))
        return done[index]

    return compiled


@pytest.mark.parametrize("index", range(len(CHECKED_IN_CUDA)), ids=lambda i: CHECKED_IN_CUDA[i].quant)
def test_checked_in_cuda_plan_is_not_stale(fresh, index):
    path, report = fresh(index)
    checked_in = REPO / report["checked_in"]
    assert checked_in.parent.name == "cuda-h200"
    assert checked_in.exists(), f"{checked_in} is missing: run `make plan` (with the CUDA venv) and commit plans/"
    assert checked_in.read_bytes() == path.read_bytes(), f"{checked_in} is stale: run `make plan` and commit plans/"
    header = load_plan(path).header
    assert header.inference.platform == "cuda" and header.inference.vllm_host["device"] == "h200"
    assert header.inference.vllm_host["attention_backend"] == "FLASH_ATTN_MLA_SPARSE"  # GLM-5.2's DSA on sm90


def test_the_fp8_cuda_seed_plan_verifies_a_routed_expert_module_against_vllms_cuda_build(fresh):
    index = next(i for i, o in enumerate(CHECKED_IN_CUDA) if o.quant == "fp8_per_block")
    path, _ = fresh(index)
    assert load_plan(path).header.quant_layout.moe == "TRITON"
    result = run_worker("verify", path, 1, 1)  # seed 1: a routed-expert module (w2, w13 and their scales)
    assert result["mismatches"] == []
    assert result["tensors"] == len(result["compared"]) >= 2
    assert any(".routed_experts.w13_weight" in c for c in result["compared"]), result["compared"]


def test_compare_platform_plans_prints_each_pair():
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "compare_platform_plans.py")], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert len(lines) == len(CHECKED_IN_CUDA) + 1 and lines[-1]["pairs"] == len(CHECKED_IN_CUDA)
    for pair in lines[:-1]:
        assert pair["fingerprints_differ"] and pair["parameters_shared"] > 0
        assert pair["header"]["cuda"]["vllm"] == "0.33.0" and pair["header"]["cpu"]["profile"]["mla_backend"] == "CPU_MLA"
