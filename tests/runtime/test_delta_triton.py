"""The Triton delta kernels (runtime/delta/triton_kernels.py) under TRITON_INTERPRET=1 on CPU tensors, byte for byte
against the numba host codec: encode (every encoding, short pages, a full region, no base), decode with corrupted
blobs refused alike, scatter through targets. In a subprocess: the variable must be set before triton is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_interpreted_triton_kernels_write_the_host_codecs_bytes():
    script = Path(__file__).with_name("delta_triton_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split() == ["encode:", "ok", "decode:", "ok", "page:", "ok"], done.stdout
