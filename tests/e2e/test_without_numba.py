"""Without numba (weightplan[host-kernels] not installed) the host fp8 quantizer takes its torch path: the same bytes."""

from __future__ import annotations

import subprocess
import sys

import torch

from weightplan.runtime.fp8.numerics import BlockQuantizer
from weightplan.runtime.fp8.rounding import ScaleRounding

QUANTIZE = """
import sys
sys.modules["numba"] = None  # `import numba` raises ImportError, as where it is not installed
import torch
from weightplan.runtime.fp8.numerics import BlockQuantizer
from weightplan.runtime.fp8.rounding import ScaleRounding

x = torch.load(sys.argv[1])
out = {}
for rounding in ScaleRounding:
    quantizer = BlockQuantizer(rounding)
    values, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(-(-x.shape[0] // 128), -(-x.shape[1] // 128))
    quantizer(x, values, scales)
    quantizer(x, values, scales)  # the second call does not try numba again: one warning
    out[rounding.value] = values.view(torch.uint8), scales
torch.save(out, sys.argv[2])
"""


def test_the_host_quantizer_without_numba_writes_the_numba_kernels_bytes(tmp_path):
    x = torch.randn(300, 400, generator=torch.Generator().manual_seed(3)) * 7
    x[:128, 128:256] = float("inf")  # a tile the kernel hands to the torch path
    x[200, 5] = float("nan")
    x = x.to(torch.bfloat16)
    torch.save(x, tmp_path / "x.pt")
    proc = subprocess.run([sys.executable, "-c", QUANTIZE, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("fp8 quantizer: numba is not installed (weightplan[host-kernels]); quantizing host tensors "
                             "in torch ops") == len(ScaleRounding), proc.stderr[-3000:]
    without = torch.load(tmp_path / "out.pt")
    for rounding in ScaleRounding:
        values, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(3, 4)
        with_numba = BlockQuantizer(rounding)
        with_numba(x, values, scales)
        assert not with_numba._numba_missing and sys.modules.get("numba") is not None  # numba's kernel ran here
        assert torch.equal(without[rounding.value][0], values.view(torch.uint8)), rounding
        assert torch.equal(without[rounding.value][1].view(torch.int32), scales.view(torch.int32)), rounding


def test_host_delta_syncs_without_numba_are_one_error_naming_the_extra(monkeypatch):
    """The host delta codec has no torch path: without numba, choosing it is one WeightplanError, not an ImportError."""
    import pytest

    from weightplan.runtime.delta.path import delta_path
    from weightplan.runtime.errors import WeightplanError

    assert delta_path([torch.zeros(4)], "auto", "trainer rank 0") == ("host", torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "numba", None)
    with pytest.raises(WeightplanError, match=r"trainer rank 0: delta syncs on host tensors need numba .*host-kernels"):
        delta_path([torch.zeros(4)], "auto", "trainer rank 0")
