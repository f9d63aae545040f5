"""Target-side progress over TCP: a trainer that computes between publish and release (never polling the runtime)
still has its agent answer the receivers' READs, so their syncs do not wait for its next release."""

from __future__ import annotations

from weightplan.testing.emulated_cluster import EmulatedCluster
from weightplan.testing.runtime_harness import Job

BUSY = 6.0  # seconds the trainer computes between publish and release


def test_reads_complete_while_the_trainer_computes_between_publish_and_release(plan_cache, tmp_path):
    """Over UCX TCP a READ is a request the trainer's agent must answer. Without progress on the trainer, each sync
    waited for the trainer's release (measured: 8.0 s for an 8 s compute, also over cma on one host); with the
    Sender's background poll between publish and release, a sync takes a small fraction of the compute."""
    path = plan_cache("tiny-qwen3-moe", "stacked", "bf16")  # one trainer rank, one inference rank
    with EmulatedCluster({"t0": None, "i0": None}, tag="wpt-prog") as cluster, \
            Job(tmp_path, path, "net-progress", cluster=cluster, store_node="t0") as job:
        job.start("tr0", "trainer", 0, "--versions", "1,2", "--gate", "--wait-joined", "--timeout", "30",
                  "--busy-after-publish", str(BUSY), node="t0")
        job.start("inf0", "inference", 0, "--plain", "--gate", "--versions", "1,2", "--timeout", "30", node="i0")
        for version in (1, 2):  # the first sync connects (UCX wire-up), the second reuses the connection
            job.go(version)
            synced = job.event("inf0", "synced", version, timeout=120)
            assert synced["n_differ"] == 0 and synced["seconds"] < BUSY / 3, synced
            released = job.event("tr0", "released", version, timeout=120)
            assert released["acked"] == [0], released
        job.assert_clean_exit("inf0", "tr0")
