"""Elasticity and faults with processes really started late or killed (SIGKILL), over NIXL/UCX on loopback (and a
trainer killed mid-sync also read directly, in a job with a secret)."""

from __future__ import annotations

import pytest

from weightplan.testing.runtime_harness import Job

TIMEOUT = 8.0  # the configured sync / release timeout of every worker in this file
SLACK = 6.0  # process scheduling on a loaded 2-core machine


@pytest.fixture
def plan(plan_cache):
    return plan_cache("tiny-glm", "hf", "fp32", "fsdp=2", "dp=2,ep")


def _synced(job: Job, key: str, version: int) -> dict:
    e = job.event(key, "synced", version)
    assert e["reported"] == version and e["tensors"] > 0 and e["n_differ"] == 0, e
    return e


def test_late_inference_rank_joins_at_the_next_sync(plan, tmp_path):
    with Job(tmp_path, plan, "late") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2,3", "--gate", "--timeout", str(TIMEOUT))
        job.start("inf0", "inference", 0, "--plain", "--versions", "1,2,3", "--timeout", "60")
        job.event("inf0", "joined")
        job.go(1)
        _synced(job, "inf0", 1)
        for r in range(2):
            assert job.event(f"tr{r}", "released", 1)["acked"] == [0]
        job.start("inf1", "inference", 1, "--plain", "--versions", "2,3", "--timeout", "60")
        job.event("inf1", "joined")
        job.go(2)
        job.go(3)
        for k in range(2):
            _synced(job, f"inf{k}", 2)
            _synced(job, f"inf{k}", 3)
        for r in range(2):
            assert job.event(f"tr{r}", "released", 2)["acked"] == [0, 1]
        job.assert_clean_exit()


@pytest.mark.parametrize("secret", [None, "weightplan-faults-test-secret"], ids=["nixl", "same-node"])
def test_trainer_killed_mid_sync_fails_that_sync_then_a_restarted_trainer_restores_it(plan, tmp_path, monkeypatch, secret):
    """Without a secret the trainers are read over NIXL; with one, directly (process_vm_readv), where the dead trainer's
    identity check fails the READs posted after it died."""
    if secret is not None:
        monkeypatch.setenv("WEIGHTPLAN_SECRET", secret)  # the store here and the workers (they inherit the environment)
    with Job(tmp_path, plan, "trainer-dies") as job:
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2,3", "--gate", "--timeout", str(TIMEOUT))
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", "1,2,3", "--hold-at", "2",
                      "--timeout", str(TIMEOUT))
            job.event(f"inf{k}", "joined")
        job.go(1)
        for k in range(2):
            assert list(_synced(job, f"inf{k}", 1)["paths"]) == ["nixl" if secret is None else "process_vm_readv"]
        job.go(2)
        for k in range(2):
            job.event(f"inf{k}", "mid-sync", 2)  # both are between their READs and the end of the sync
        job.kill("tr1")
        job.resume(2)
        for k in range(2):
            failed = job.event(f"inf{k}", "failed", 2)
            assert failed["reported"] is None, "a failed sync must not report a version"
            assert "weights are incomplete" in failed["error"] and "trainer" in failed["error"]
            assert failed["seconds"] <= TIMEOUT + SLACK
        released = job.event("tr0", "released", 2)
        assert released["acked"] == [] and released["failed"] == [0, 1]
        job.start("tr1b", "trainer", 1, "--versions", "3", "--gate", "--timeout", str(TIMEOUT))
        job.event("tr1b", "ready")
        job.go(3)
        for k in range(2):
            _synced(job, f"inf{k}", 3)
        job.assert_clean_exit("tr0", "tr1b", "inf0", "inf1")


def test_inference_rank_killed_mid_sync_blocks_nobody_beyond_the_timeout(plan, tmp_path):
    with Job(tmp_path, plan, "inference-dies") as job:
        job.start("inf0", "inference", 0, "--plain", "--versions", "1,2,3", "--timeout", "60")
        job.start("inf1", "inference", 1, "--plain", "--versions", "1,2,3", "--hold-at", "2", "--timeout", "60")
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2,3", "--wait-joined", "--timeout", str(TIMEOUT))
        for r in range(2):
            assert job.event(f"tr{r}", "released", 1)["acked"] == [0, 1]
        job.event("inf1", "mid-sync", 2)
        job.kill("inf1")
        for r in range(2):
            released = job.event(f"tr{r}", "released", 2)
            assert released["acked"] == [0] and released["timed_out"] == [1]
            assert released["seconds"] <= TIMEOUT + SLACK
            third = job.event(f"tr{r}", "released", 3)
            assert third["acked"] == [0] and third["timed_out"] == []
            assert third["seconds"] < TIMEOUT, "a rank given up on is not waited for again"
        for version in (1, 2, 3):
            _synced(job, "inf0", version)
        job.assert_clean_exit("tr0", "tr1", "inf0")
