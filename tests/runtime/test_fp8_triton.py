"""runtime/fp8/triton_quant.py, the very kernel a GPU runs, under Triton's interpreter on this CPU: its e4m3fn rounding
against torch, and its bytes against the host rule of runtime/fp8/rounding.py under both scale roundings.

Each check runs tests/runtime/fp8_triton_interpreted.py in a process of its own with TRITON_INTERPRET=1: the
interpreter is chosen when a kernel is defined, and in this process triton may already be imported without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from weightplan.runtime.errors import WeightplanError  # noqa: E402
from weightplan.runtime.fp8.rounding import ScaleRounding  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _interpreted(check: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "tests.runtime.fp8_triton_interpreted", check], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and f"{check}: ok" in run.stdout, (run.stdout + run.stderr)[-4000:]


def test_kernel_rounding_equals_torch_on_every_cut():
    _interpreted("rounding")


def test_kernel_equals_the_rule_under_both_roundings_on_any_tiles():
    _interpreted("property")


def test_the_two_rules_give_other_bytes_and_the_kernel_follows_each():
    _interpreted("rules_differ")


@pytest.mark.parametrize("case", ["dtype", "partial tile", "column stride", "too small scales", "host tensors"])
def test_wrong_views_are_refused_in_one_line(case):
    from weightplan.runtime.fp8.triton_quant import interpreted, quantize_tiles_triton

    if case == "host tensors" and interpreted():
        pytest.skip("this process set TRITON_INTERPRET=1: host tensors are what the interpreter runs")

    x = torch.zeros(256, 256, dtype=torch.bfloat16)
    values = torch.empty(256, 256, dtype=torch.float8_e4m3fn)
    scales = torch.empty(2, 2)
    hf = wf = 256
    if case == "dtype":
        x = x.float()
    elif case == "partial tile":
        hf = 200
    elif case == "column stride":
        x = torch.zeros(256, 512, dtype=torch.bfloat16)[:, ::2]
    else:
        scales = torch.empty(1, 2)
    with pytest.raises(WeightplanError, match="triton fp8 quantizer") as err:
        quantize_tiles_triton(x, values, scales, hf, wf, ScaleRounding.CUDA)
    assert "\n" not in str(err.value)
