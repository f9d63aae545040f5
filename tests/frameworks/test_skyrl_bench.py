"""`bench_frameworks.py --smoke --only skyrl` in the vLLM 0.30 venv (`make test-compat VLLM=0.30.0`): it runs, its JSON
line has every key, and each step the engine held vLLM's own load of the gathered state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("skyrl", reason="SkyRL is installed only in the vLLM 0.30 venv (make test-compat VLLM=0.30.0)")
pytest.importorskip("ray", reason="SkyRL's trainer-side weight sync imports ray (make venv-compat VLLM=0.30.0)")

from weightplan.testing.engines import ROOT  # noqa: E402

KEYS = {"update_s", "baseline_s", "speedup", "identical", "baseline_identical", "first_update_s", "first_baseline_s",
        "engine_build_s", "steps", "trainers", "engines", "parameters", "skyrl", "vllm", "baseline"}


def test_skyrl_entry_smoke_run(tmp_path):
    bench = [str(ROOT / "benchmarks" / "bench_frameworks.py"), "--smoke", "--only", "skyrl",
             "--workdir", str(tmp_path / "bench")]
    done = subprocess.run([sys.executable, *bench], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert set(figures) == {"skyrl"}
    skyrl = figures["skyrl"]
    assert set(skyrl) == KEYS
    assert skyrl["steps"] == 3 and skyrl["identical"] is True and skyrl["baseline_identical"] is True
    assert skyrl["update_s"] > 0 and skyrl["baseline_s"] > 0 and skyrl["speedup"] > 0
    steps = [json.loads(line) for line in lines[:-1] if line.startswith('{"event": "step"')]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["digests"] > 0 and s["digests_differ"] == [] == s["baseline_digests_differ"] for s in steps)
    assert (tmp_path / "bench" / "skyrl" / "weightplan" / "skyrl.plan").is_file()


def test_skyrl_entry_is_refused_in_one_line_without_skyrl():
    """The same option under the main venv's interpreter (which has no SkyRL) names the venv to use."""
    main_python = ROOT / ".venv" / "bin" / "python"
    if not main_python.exists():
        pytest.skip("no .venv here (make venv)")
    done = subprocess.run([str(main_python), str(ROOT / "benchmarks" / "bench_frameworks.py"), "--only", "skyrl"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("the skyrl entry needs SkyRL 0.4.0 and ray (No module named ")
    assert line.endswith("), installed only in the vLLM 0.30 venv: run it with .venv-vllm-0.30.0/bin/python "
                         "(make bench-frameworks-skyrl)")
