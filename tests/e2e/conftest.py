"""The wheel a user installs, built once per test session (tests/e2e/test_wheel.py, test_install_resolution.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    (found,) = out.glob("weightplan-*.whl")
    return found
