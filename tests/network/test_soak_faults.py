"""Short soaks (benchmarks/soak.py) with each fault of issue 52 forced once: trainers restarted, an etcd member killed and
one cut off, a pool replica joined and one left (etcd, make test-extended); vLLM's balancer rearranging the experts of
an EPLB plan (make test); no mixed bytes, no hang, no reader restarted."""

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


EPLB_FAULTS = ("experts_rearranged", "kill_restart")
# Seed 25 at a fault rate of 0.7 over 10 syncs rearranges the experts at versions 3, 5 and 6 and kills a process at 4
# and 8; versions 9 and 10 are fault-free, so the last fault can recover.
EPLB_ARGS = ("--eplb", "--faults", ",".join(EPLB_FAULTS), "--fault-rate", "0.7", "--syncs", "10", "--seed", "25")


def test_an_eplb_soak_follows_vllms_rearrangements_with_no_engine_restarted():
    """The checked-in EPLB plan over emulated nodes: vLLM's own balancer rearranges the experts between syncs and each
    reader makes a Receiver on the new table; every reader's bytes equal the reference under the table in force."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the soak needs {', '.join(missing)} on PATH (iproute2)")
    if os.geteuid() != 0:
        pytest.skip("the soak needs root (network namespaces and tc)")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), *EPLB_ARGS], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"soak.py exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["mixed"] == 0 and figures["hangs"] == 0 and figures["engines_restarted"] == 0, figures
    assert figures["stopped"] is None and figures["completed"] >= 5, figures
    assert figures["faults"]["experts_rearranged"] >= 1, figures["faults"]
    for fault in figures["fault_log"]:
        assert fault["recovered"] and fault["after_versions"] is not None, fault
    followed = [line for line in proc.stderr.splitlines() if '"experts_rearranged"' in line and '"completed"' in line]
    assert followed, "no sync right after a rearrangement completed"
