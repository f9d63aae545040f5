"""Every benchmark the README lists runs to its JSON line in its smallest configuration (--smoke); keys, never figures.

`make demo` (examples/rl_loop.py with a vLLM engine) runs in tests/runtime/test_live_trainer.py, which checks more than keys.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
TIMEOUT = 600  # seconds per benchmark process; the smoke runs take 20-120 s each on 2 shared cores


def last_json(script: str, *args: str, cwd: Path = ROOT) -> tuple[dict | list, str]:
    """Run benchmarks/`script` with `args`; its last stdout line as JSON, and its whole stdout."""
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, f"{script} exited with {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1]), proc.stdout


def assert_keys(figures: dict, keys: set[str], script: str) -> None:
    missing = keys - set(figures)
    assert not missing, f"{script}'s JSON line lacks {sorted(missing)}: {figures}"


@pytest.fixture(scope="module")
def runtime_output(tmp_path_factory) -> Path:
    """One bench_runtime.py --smoke run with its fp8 job; bench_cluster's local calibration reads it too."""
    figures, stdout = last_json("bench_runtime.py", "--smoke", "--quant", "fp8_per_block")
    path = tmp_path_factory.mktemp("bench-runtime") / "bench_runtime_smoke.txt"
    path.write_text(stdout)
    return path


def test_bench_compile_smoke():
    rows, _ = last_json("bench_compile.py", "--smoke", "--repeat", "2")
    assert isinstance(rows, list) and len(rows) == 1, rows
    assert_keys(rows[0], {"plan", "compile_s", "wall_s", "peak_rss_mb", "descriptors", "descriptors_lower_bound",
                          "plan_bytes", "src_balance", "wire_over_dst", "identical_to_checked_in", "tp_ranks_derived",
                          "derive_cpu_s"}, "bench_compile.py")
    rounds = rows[0]["compile_cpu_s_rounds"]
    assert len(rounds) == 2 and rows[0]["compile_cpu_s"] == sorted(rounds)[0]  # the lower middle of two rounds


def test_bench_runtime_smoke(runtime_output):
    figures = json.loads(runtime_output.read_text().strip().splitlines()[-1])
    assert_keys(figures, {"config", "measured_at", "bytes", "memcpy_gbps", "ceiling_gbps", "sync_gbps", "baseline_gbps",
                          "sync_vs_ceiling", "speedup_vs_baseline", "host_overhead_ms_10k", "host_overhead_ms_100k",
                          "strided_sync_vs_ceiling", "strided_table_bytes", "strided_ring_sync_vs_ceiling", "cores",
                          "fp8_s_per_gb", "fp8_vs_bf16_per_gb", "fp8_identical"}, "bench_runtime.py")
    assert figures["config"] == "tests/configs/fp8-glm"


def test_bench_cluster_smoke(runtime_output):
    figures, stdout = last_json("bench_cluster.py", "--smoke", "--bench-output", str(runtime_output))
    assert_keys(figures, {"bf16_s", "fp8_s", "tp8_pp2_s", "tp8_pp2_node_gb", "fp8_fanout_s", "max_nic_gb",
                          "calibration_error_local", "calibration_error_published", "calibration_source", "calibration_measured_at",
                          "calibration_age_h", "fp8_fanout_delta_s", "fp8_fanout_delta_wire_ratio",
                          "fp8_fanout_delta_host_codec_s"}, "bench_cluster.py")
    assert figures["calibration_source"] == str(runtime_output)  # the run just made, named, never a saved file
    assert sorted(figures["tp8_pp2_node_gb"]) == ["inference/0", "inference/1"]  # one node per pipeline stage


def test_bench_cluster_smoke_refuses_to_read_a_saved_output():
    proc = subprocess.run([sys.executable, str(BENCH / "bench_cluster.py"), "--smoke"], cwd=ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and "--smoke needs --bench-output FILE or --measure" in proc.stderr, proc.stderr[-2000:]


def test_bench_engine_smoke():
    figures, _ = last_json("bench_engine.py", "--smoke")
    assert_keys(figures, {"update_s", "transfer_s", "post_process_s", "checkpoint_reload_s", "checkpoint_path",
                          "speedup_vs_checkpoint", "cold_start_s", "gb", "load_weights_unavailable", "full_pause_s",
                          "delta_pause_s", "full_pause_unprefetched_s", "delta_wire_ratio"}, "bench_engine.py")


def test_bench_lora_smoke():
    figures, _ = last_json("bench_lora.py", "--smoke")
    assert_keys(figures, {"update_s", "baseline_s", "speedup", "adapter_bytes", "identical", "update_breakdown"},
                "bench_lora.py")
    assert_keys(figures["update_breakdown"], {"publish_s", "start_rpc_s", "update_rpc_s", "finish_rpc_s", "release_s",
                                              "worker_update_s", "wait_s", "read_s", "restore_s"}, "bench_lora.py")
    assert figures["identical"] is True, figures


@pytest.mark.extended  # the session's framework run (about 4 minutes): make test-extended
def test_bench_frameworks_smoke(framework_runs):
    """The session's one smoke run (tests/support/framework_runs.py; test_trl.py and test_verl.py check its steps)."""
    figures = framework_runs.figures
    assert_keys(figures, {"trl", "verl"}, "bench_frameworks.py")
    for framework in ("trl", "verl"):
        assert_keys(figures[framework], {"update_s", "baseline_s", "speedup", "identical"}, "bench_frameworks.py")
        assert figures[framework]["identical"] is True, figures
        assert figures[framework]["steps"] == 3 and figures[framework]["update_s"] > 0, figures


def test_bench_frameworks_refuses_a_workdir_in_use(tmp_path):
    (tmp_path / "kept").write_text("")
    proc = subprocess.run([sys.executable, str(BENCH / "bench_frameworks.py"), "--smoke", "--workdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [f"--workdir {tmp_path} is not empty"]


def test_bench_trainer_smoke():
    figures, _ = last_json("bench_trainer.py", "--smoke")
    assert_keys(figures, {"publish_s", "sync_s", "end_to_end_s", "baseline_s", "speedup", "staging_bytes",
                          "staging_ratio", "identical", "digests"}, "bench_trainer.py")


def test_soak_smoke():
    """Eight syncs over emulated nodes with one link flap, one kill and restart, one slow link and a long cut of a
    reader's node and of a trainer's (root and iproute2)."""
    figures, _ = last_json("soak.py", "--smoke")
    assert_keys(figures, {"syncs", "completed", "failed_clean", "mixed", "hangs", "recovered", "seconds", "faults",
                          "longest_cut_s", "restarted_for_cut", "fault_log"}, "soak.py")
    for fault in figures["fault_log"]:
        assert_keys(fault, {"version", "kind", "node", "recovered", "after_versions"}, "soak.py fault_log")


def test_bench_network_smoke():
    figures, _ = last_json("bench_network.py", "--smoke")
    assert_keys(figures, {"rates", "max_abs_error", "bytes_per_reader", "measured_at"}, "bench_network.py")
    for row in figures["rates"].values():
        assert_keys(row, {"measured_s", "predicted_s", "error"}, "bench_network.py")


def test_progress_cost_smoke():
    figures, _ = last_json("progress_cost.py", "--smoke")
    assert_keys(figures, {"idle_cpu_per_wall_s"}, "progress_cost.py")
    assert_keys(figures["idle_cpu_per_wall_s"], {"none", "poll", "thread"}, "progress_cost.py")


def test_sweep_smoke(tmp_path):
    figures, _ = last_json("sweep.py", "--only", "llama", "--workdir", str(tmp_path))
    assert_keys(figures, {"attempted", "compiled", "verified", "failures", "vllm_cpu_cannot_build", "vllm_cannot_load"},
                "sweep.py")
    assert figures["attempted"] > 0, figures


def test_ceiling_reads_continue_after_a_short_read_and_name_what_failed():
    """runtime_bench_worker._readv: every iovec read whole, and a failing one raises naming pid, address and bytes read."""
    sys.path.insert(0, str(BENCH))
    from runtime_bench_worker import _readv

    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, dtype=np.uint8)
    base_src, base_dst = src.ctypes.data, dst.ctypes.data
    pid = os.getpid()
    sizes = np.array([64, 1, 63], dtype=np.int64)
    starts = np.array([0, 100, 190], dtype=np.int64)
    assert _readv(pid, base_dst + starts, base_src + starts, sizes) == 128
    for start, size in zip(starts.tolist(), sizes.tolist()):
        assert (dst[start:start + size] == src[start:start + size]).all()
    with pytest.raises(OSError, match=rf"pid {pid} at remote address 0x10: read 64 of 128 bytes"):
        # the kernel reads the first iovec, then the next call faults on address 0x10
        _readv(pid, base_dst + np.array([0, 64]), np.array([base_src, 16]), np.array([64, 64]))


def test_the_gpu_checks_fp8_plan_is_what_the_compiler_writes_now(plan_cache):
    """benchmarks/data/gpu-check-fp8.plan is carried to GPU machines (they have no vLLM to compile it): it must be
    today's compile of its case, or the check would prove an old format. Rewrite it with the command below."""
    from weightplan.runtime import load_plan

    from ..support.fp8 import CASES

    model, fmt, trainer, inference = CASES["deepseek"]
    fresh = load_plan(plan_cache(model, fmt, "bf16", trainer, inference, quant="fp8_per_block"))
    carried = load_plan(BENCH / "data" / "gpu-check-fp8.plan")
    assert carried.fingerprint == fresh.fingerprint, (
        "rewrite it: python -c \"from weightplan.compiler.compile import CompileOptions, compile_plan; compile_plan("
        "CompileOptions('tests/configs/fp8-deepseek-v3', 'hf', 'bf16', 'fp8_per_block', "
        "'benchmarks/data/gpu-check-fp8.plan', trainer='fsdp=3', inference='tp=2'))\"")


def test_measure_delta_codec_smoke(tmp_path):
    """The README's measure of the host delta codec's rates, and its --write into a copy of the seed cluster file."""
    cluster = tmp_path / "cluster.json"
    cluster.write_text((ROOT / "compiler" / "simulate" / "clusters" / "dgx-h200-seed.json").read_text())
    figures, _ = last_json("measure_delta_codec.py", "--smoke", "--write", str(cluster))
    assert_keys(figures, {"density", "pages", "delta_bytes", "delta_encode_gbytes_per_s", "delta_apply_gbytes_per_s",
                          "measured_at"}, "measure_delta_codec.py")
    assert figures["pages"] == 4 and figures["delta_encode_gbytes_per_s"] > 0 and figures["delta_apply_gbytes_per_s"] > 0
    written = json.loads(cluster.read_text())
    assert written["delta_encode_gbytes_per_s"] == figures["delta_encode_gbytes_per_s"]
    assert "measure_delta_codec.py" in written["sources"]["delta_apply_gbytes_per_s"]


def test_bench_delta_smoke():
    figures, _ = last_json("bench_delta.py", "--smoke")
    cases = {"lr_1e-05", "fp8_lr_1e-05"}
    assert_keys(figures, cases | {"config", "trainers", "date"}, "bench_delta.py")
    for case in cases:
        assert_keys(figures[case], {"density", "delta_wire_ratio", "delta_sync_s", "full_sync_s", "identical",
                                    "sender_extra_bytes", "delta_took", "compared_fraction"}, "bench_delta.py")
        assert figures[case]["identical"] is True, figures[case]  # a delta chain that is not bit-exact is a failure


def test_compare_platform_plans_smoke():
    """Reads the checked-in plan files only; the figures are docs/cuda.md's (its own test: tests/cuda/test_glm_cuda_plans.py)."""
    summary, stdout = last_json("compare_platform_plans.py")
    assert_keys(summary, {"pairs", "same_parameters_and_runs"}, "compare_platform_plans.py")
    pairs = [json.loads(line) for line in stdout.strip().splitlines()[:-1]]
    assert len(pairs) == summary["pairs"] >= 2
    for pair in pairs:
        assert_keys(pair, {"parameters_shared", "runs_identical_by_name", "descriptors", "wire_bytes", "plan_file_bytes"},
                    "compare_platform_plans.py")
