"""A short etcd soak (benchmarks/soak.py) with each fault of issue 52 forced once: trainers restarted, an etcd member
killed and one cut off, a pool replica joined and one left; no mixed bytes, no hang, no reader restarted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEW_FAULTS = ("trainers_restarted", "etcd_member_killed", "etcd_member_cut", "replica_joined", "replica_left")
# Seed 9 at a fault rate of 0.7 over 9 syncs draws the five kinds at versions 3-7 (each listed kind once first), so
# versions 8 and 9 are fault-free and the last fault can recover.
ARGS = ("--rendezvous", "etcd", "--faults", ",".join(NEW_FAULTS), "--fault-rate", "0.7", "--syncs", "9", "--seed", "9")


@pytest.mark.extended  # about 40 s alone on 2 cores: make test-extended
def test_an_etcd_soak_recovers_from_every_new_fault():
    missing = [tool for tool in ("ip", "tc", "etcd") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the etcd soak needs {', '.join(missing)} on PATH (iproute2; Debian's etcd-server)")
    if os.geteuid() != 0:
        pytest.skip("the etcd soak needs root (network namespaces and tc)")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), *ARGS], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"soak.py exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["mixed"] == 0 and figures["hangs"] == 0 and figures["engines_restarted"] == 0, figures
    assert figures["stopped"] is None, figures
    for kind in NEW_FAULTS:
        assert figures["faults"][kind] >= 1, (kind, figures["faults"])
    logged = [fault for fault in figures["fault_log"] if fault["kind"] in NEW_FAULTS]
    assert {fault["kind"] for fault in logged} == set(NEW_FAULTS), figures["fault_log"]
    for fault in logged:
        assert fault["recovered"] and fault["after_versions"] is not None, fault
