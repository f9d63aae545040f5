"""Run tests/cuda only inside the CUDA venv (make venv-cuda), with vLLM's CUDA platform pinned to the H200 profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from weightplan.compiler.frontend.cuda_platform import vllm_distribution

REPO = Path(__file__).resolve().parents[2]
DEVICE = "h200"  # the profile this process traces for; other profiles run in a subprocess (the pin is per process)


def skip_reason() -> str | None:
    """Why tests/cuda cannot run in this interpreter, or None."""
    venvs = sorted(REPO.glob(".venv-vllm-*-cuda"))
    if not venvs:
        return "no .venv-vllm-*-cuda: `make venv-cuda` creates it, `make test-cuda` runs these tests there (docs/cuda.md)"
    if vllm_distribution() != "vllm":
        return f"these tests trace vLLM's CUDA build: `make test-cuda` runs them in {venvs[-1].name} (docs/cuda.md)"
    return None


SKIP = skip_reason()
if SKIP is None:  # pinned before any test module asks vLLM for its platform (pytest loads this conftest first)
    from weightplan.compiler.frontend.cuda_platform import trace_cuda

    trace_cuda(DEVICE, "tests/cuda")


def pytest_collection_modifyitems(config, items):
    if SKIP is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP))
