"""`make gpu-check` without a GPU (every part skipped, exit 0), its harness on host memory, its UCX log parser, its sleep."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402 - benchmarks/ is no package
import ucx_proto_info  # noqa: E402

KEYS = {"parts", "targets", "logs", "environment", *gpu_check.FIGURES}


def run(command: list[str], tmp_path: Path) -> tuple[dict, str]:
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{command} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def assert_all_skipped(figures: dict, stdout: str, because: str) -> None:
    assert KEYS <= set(figures), sorted(KEYS - set(figures))
    assert list(figures["parts"]) == list(gpu_check.PARTS), figures["parts"]
    for name, part in figures["parts"].items():
        assert part["status"] == "skipped" and because in part["reason"], (name, part)
        assert f"{name}: skipped ({because}" in stdout
    assert all(figures[k] is None for k in gpu_check.FIGURES), figures
    assert {t["met"] for t in figures["targets"].values()} == {None}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is here: make gpu-check runs every part")
def test_make_gpu_check_without_a_gpu_skips_every_part_with_its_reason_and_exits_0(tmp_path):
    figures, stdout = run(["make", "-s", "gpu-check", f"GPU_CHECK_ARGS=--logs {tmp_path}"], tmp_path)
    assert_all_skipped(figures, stdout, "no CUDA device")
    assert figures["environment"]["executable"].endswith(".venv/bin/python") or not (ROOT / ".venv").exists()


def test_gpu_check_with_a_python_without_torch_skips_every_part_and_exits_0(tmp_path):
    """What a bare `python3` gets (issue 40: it died in `import torch`): -S leaves the venv's packages out."""
    figures, stdout = run([sys.executable, "-S", "benchmarks/gpu_check.py"], tmp_path)
    assert_all_skipped(figures, stdout, "no PyTorch in")


def test_gpu_check_harness_syncs_host_memory_between_processes(tmp_path):
    """--device cpu runs the sync parts' processes, plans and checks on host memory: the harness itself works here,
    every worker's log is kept, the READs' transport is read from UCX's tables, and the fp8 part (5 processes) takes
    the GPU's fp8 code path on host tensors."""
    figures, _ = run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--parts", "sync_vram,sync_fp8",
                      "--mib", "4", "--logs", str(tmp_path)], tmp_path)
    part = figures["parts"]["sync_vram"]
    variant = part["variants"]["nixl default"]
    assert part["status"] == "ok" and variant["status"] == "ok" and len(variant["seconds"]) == 3, part
    assert variant["bytes"] == 4 << 20 and variant["transports"], variant
    assert figures["sync_gbytes_per_s"] == part["best_gbytes_per_s"] > 0
    assert figures["logs"] == str(tmp_path) and all((tmp_path / name).exists() for name in variant["logs"]), variant
    assert any("UCX  INFO" in (tmp_path / name).read_text() for name in variant["logs"])
    fp8 = figures["parts"]["sync_fp8"]
    assert fp8["status"] == "ok" and (fp8["trainers"], fp8["receivers"], fp8["versions"]) == (3, 2, 3), fp8


def test_ucx_proto_info_tables_name_the_transports_that_carried_the_reads():
    text = (Path(__file__).parent / "data" / "ucx-proto-info.log").read_text()
    tables = ucx_proto_info.tables(text)
    assert [t["operation"] for t in tables] == [
        "remote memory write by ucp_put* from host memory to host", "active message by ucp_am_send* from host memory",
        "remote memory read by ucp_get*(multi) into cuda/GPU0 memory from cuda/GPU0"]
    read = tables[-1]
    assert read["endpoint"] == "gpucheck5811x418037102.inferenc intra-node cfg#1"
    assert read["rows"] == [("0..8192", "fragmented copy-in copy-out", "cuda_copy/cuda and tcp/lo"),
                            ("8193..inf", "(?) zero-copy", "60% on cuda_ipc/cuda and 40% on tcp/lo")]
    found = ucx_proto_info.transports(text)
    assert found["read"] == ["cuda_copy", "cuda_ipc", "tcp"]
    assert found["read_detail"] == ["cuda_copy/cuda", "cuda_ipc/cuda", "tcp/lo"]
    assert found["by_operation"]["active message by ucp_am_send* from host memory"] == ["tcp/lo"]
    assert ucx_proto_info.transports("no tables here\n{}")["read"] == []


def test_the_sleeping_kernel_outlasts_twenty_syncs_at_the_highest_clock():
    cycles, seconds = gpu_check.sleep_cycles(0.5, 1.98e9)  # issue 40: 2 GiB at 0.5 GB/s would be 4 s, 256 MiB 0.5 s
    assert seconds == 10.0 and cycles == int(10.0 * 1.98e9)
    assert gpu_check.sleep_cycles(1e-4, 1.98e9) == (int(0.2 * 1.98e9), 0.2)  # floored: a fast sync still waits 0.2 s
    assert gpu_check.sleep_cycles(10.0, 1.98e9)[1] == 15.0  # capped to fit the part's deadline
    # the H200 run's fixed 400M cycles was about 0.2 s: for that run's 256 MiB sync (0.47 s) the rule asks 47x as many
    assert gpu_check.sleep_cycles(0.47, 1.98e9)[0] > 20 * 400_000_000
    with pytest.raises(ValueError, match="clock > 0"):
        gpu_check.sleep_cycles(0.1, 0)
