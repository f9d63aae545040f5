"""The compiler's public Python API: the names docs/python-api.md uses, importable without importing vLLM first."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_public_names_resolve_lazily():
    code = ("import sys, weightplan.compiler as c; assert 'vllm' not in sys.modules, 'package import pulled vLLM'; "
            "from weightplan.compiler import compile_plan, CompileOptions, summarize, VerifyResult; "
            "from weightplan.compiler.verify_plan import verify_plan; "
            "assert callable(compile_plan) and callable(verify_plan) and callable(summarize), 'not functions'; "
            "print(','.join(c.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(",") == ["CompileOptions", "CompileResult", "VerifyResult", "compile_plan",
                                             "default_plan_path", "known_models", "render_text", "summarize"]


def test_unknown_name_is_an_attribute_error():
    import weightplan.compiler as c

    with pytest.raises(AttributeError, match="compile_everything"):
        c.compile_everything
