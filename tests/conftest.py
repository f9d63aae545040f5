"""Shared fixtures: small model configs and a cache of plans compiled in this test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

CONFIGS = Path(__file__).parent / "configs"
TINY_MODELS = ("tiny-glm", "tiny-deepseek-v3", "tiny-qwen3-moe", "tiny-llama")


def config_dir(name: str) -> Path:
    return CONFIGS / name


@pytest.fixture(scope="session")
def plan_cache(tmp_path_factory):
    """compile(model, fmt, dtype) -> path of a plan compiled once per session."""
    from weightplan.compiler.compile import CompileOptions, compile_plan

    root = tmp_path_factory.mktemp("plans")
    cache: dict[tuple, Path] = {}

    def compile(model: str, fmt: str = "hf", dtype: str = "bf16", trainer: str = "fsdp=1", inference: str = "tp=1") -> Path:
        key = (model, fmt, dtype, trainer, inference)
        if key not in cache:
            out = root / f"{model}-{fmt}-{dtype}-{trainer}-{inference}.plan".replace(",", "_").replace("=", "")
            compile_plan(CompileOptions(str(config_dir(model)), fmt, dtype, "none", out, trainer=trainer, inference=inference))
            cache[key] = out
        return cache[key]

    return compile
