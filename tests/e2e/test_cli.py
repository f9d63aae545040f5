"""The console scripts as users run them: output, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import config_dir

BIN = Path(sys.executable).parent


def run(*args, check=True):
    proc = subprocess.run([str(BIN / args[0]), *map(str, args[1:])], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_compile_inspect_verify(tmp_path):
    plan = tmp_path / "tiny.plan"
    out = run("compile-plan", "--model", config_dir("tiny-glm"), "--trainer-format", "stacked", "--trainer-dtype", "fp32", "-o", plan)
    assert out.stdout.startswith(f"compiled {plan}:")
    assert "tracing tiny-glm: 100% of traced trainer tensors" in out.stderr

    summary = json.loads(run("inspect-plan", plan, "--json").stdout)
    required = {"format_version", "model", "trainer", "inference", "quant", "src_ranks", "dst_ranks", "dst_tensors",
                "dst_bytes", "wire_bytes", "descriptors", "descriptors_lower_bound", "dst_coverage", "fingerprint"}
    assert required <= set(summary)
    assert summary["dst_coverage"] == 1.0
    assert summary["descriptors"] == summary["descriptors_lower_bound"]
    assert summary["wire_bytes"] == summary["dst_bytes"]

    verified = run("verify-plan", plan, "--model", config_dir("tiny-glm"))
    last = verified.stdout.strip().splitlines()[-1]
    assert last == f"verified: {summary['dst_tensors']} tensors, {summary['dst_bytes']} bytes identical to vLLM"

    sampled = run("verify-plan", plan, "--model", config_dir("tiny-glm"), "--sample", "5")
    assert sampled.stdout.strip().splitlines()[-1].startswith("verified: 5 tensors")


def test_errors_are_one_line_without_traceback(tmp_path):
    proc = run("compile-plan", "--model", "no-such-model", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in proc.stderr

    garbage = tmp_path / "garbage.plan"
    garbage.write_bytes(b"WPLAN\x00\r\n" + b"\x00" * 40)
    proc = run("inspect-plan", garbage, check=False)
    assert proc.returncode == 2
    assert "truncated or corrupted" in proc.stderr and "Traceback" not in proc.stderr
    proc = run("verify-plan", garbage, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    proc = run("verify-plan", garbage, "--ranks", "0,x", check=False)
    assert proc.returncode == 2 and "expected comma-separated inference ranks such as 0,5, got '0,x'" in proc.stderr
    for value in ("0", "-5"):
        proc = run("verify-plan", garbage, "--sample", "2", "--max-tensor-bytes", value, check=False)
        assert proc.returncode == 2 and f"--max-tensor-bytes must be at least 1, got {value}" in proc.stderr
    proc = run("compile-plan", "--model", "glm-5.2", "-o", "", check=False)
    assert proc.returncode == 2 and "argument -o/--output: is empty; give a plan file path" in proc.stderr
