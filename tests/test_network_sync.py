"""Syncs across emulated nodes (network namespaces on a bridge, UCX over TCP, the store off loopback with the job
secret): 2 trainer nodes x 2 ranks to 2 inference nodes x 2 ranks, with node-local fan-out, bf16 and fp8_per_block,
every version's digests equal to vLLM's own load."""

from __future__ import annotations

from .conftest import config_dir
from .runtime_harness import Job
from .support.emulated_cluster import EmulatedCluster

BF16 = ("tiny-qwen3-moe", "transformers", "bf16", "fsdp=4", "dp=4,ep,gpus-per-node=2")
FP8 = ("fp8-deepseek-v3", "transformers", "bf16", "fsdp=4", "dp=4,ep,gpus-per-node=2", "fp8_per_block")
NODES = {"t0": None, "t1": None, "i0": None, "i1": None}  # trainer ranks 0-1, 2-3; inference ranks 0-1, 2-3


def test_two_trainer_nodes_sync_two_inference_nodes_over_tcp_with_fanout(plan_cache, tmp_path):
    plans = [plan_cache(*BF16), plan_cache(*FP8)]
    models = ",".join(str(config_dir(case[0])) for case in (BF16, FP8))
    with EmulatedCluster(NODES, tag="wpt-sync") as cluster, \
            Job(tmp_path, ",".join(map(str, plans)), "net-bf16,net-fp8", cluster=cluster, store_node="t0") as job:
        for k in range(4):
            job.start(f"inf{k}", "inference", k, "--versions", "1,2", "--model", models, "--verify", "--timeout", "300",
                      node=f"i{k // 2}")
        for r in range(4):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2", "--digests", "--wait-joined", "--timeout", "300",
                      node=f"t{r // 2}")
        job.assert_fanout_syncs(dict(zip(("net-bf16", "net-fp8"), plans)), (1, 2), readers=4, trainers=4, timeout=600)
        job.assert_clean_exit(*(f"inf{k}" for k in range(4)), *(f"tr{r}" for r in range(4)))


LINK_TIMEOUT = 10.0  # the workers' sync and release timeout in the fault tests


def test_an_inference_node_cut_mid_sync_fails_clean_then_syncs_again_after_the_link_returns(plan_cache, tmp_path):
    """Node i1 (inference ranks 2, 3) loses its link in the middle of version 2: its ranks fail version 2 with a
    SyncError and report no version (their weights are incomplete); node i0 completes version 2. Version 3 starts the
    moment the link is back: i1's ranks either sync it or fail it cleanly within their timeout (TCP connections that
    backed off during the cut may not carry traffic yet). Once the link carries traffic, version 4 syncs everywhere,
    with no process restarted."""
    path = plan_cache(*BF16[:4], "dp=4,ep")
    with EmulatedCluster({"t0": None, "i0": None, "i1": None}, tag="wpt-cut") as cluster, \
            Job(tmp_path, path, "net-cut", cluster=cluster, store_node="t0") as job:
        for r in range(4):
            job.start(f"tr{r}", "trainer", r, "--versions", "1,2,3,4", "--gate", "--wait-joined",
                      "--timeout", str(LINK_TIMEOUT), node="t0")
        for k in range(4):
            hold = ("--hold-at", "2") if k >= 2 else ()
            job.start(f"inf{k}", "inference", k, "--plain", "--gate", "--versions", "1,2,3,4", "--timeout", str(LINK_TIMEOUT),
                      *hold, node=f"i{k // 2}")
        job.go(1)
        for k in range(4):
            assert job.event(f"inf{k}", "synced", 1)["n_differ"] == 0
        job.go(2)
        for k in (2, 3):
            job.event(f"inf{k}", "mid-sync", 2)
        cluster.link_down("i1")
        job.resume(2)
        for k in (0, 1):
            assert job.event(f"inf{k}", "synced", 2)["n_differ"] == 0
        for k in (2, 3):
            failed = job.event(f"inf{k}", "failed", 2, timeout=6 * LINK_TIMEOUT)
            assert failed["reported"] is None, failed  # incomplete weights: no version until a sync succeeds
        for r in range(4):
            job.event(f"tr{r}", "released", 2, timeout=6 * LINK_TIMEOUT)
        cluster.link_up("i1")
        job.go(3)
        for k in range(4):
            e = job.outcome(f"inf{k}", 3, timeout=6 * LINK_TIMEOUT)
            assert (e["event"], e["reported"], e.get("n_differ", 0)) in {("synced", 3, 0), ("failed", None, 0)}, e
            assert k >= 2 or e["event"] == "synced", e  # node i0 never lost its link
        for r in range(4):
            job.event(f"tr{r}", "released", 3, timeout=6 * LINK_TIMEOUT)
        host, port = job.address.rsplit(":", 1)
        cluster.wait_reachable("i1", host, int(port))  # the link carries traffic again
        job.go(4)
        for k in range(4):
            e = job.event(f"inf{k}", "synced", 4, timeout=6 * LINK_TIMEOUT)
            assert e["reported"] == 4 and e["n_differ"] == 0, e
        job.assert_clean_exit(*(f"inf{k}" for k in range(4)), *(f"tr{r}" for r in range(4)))
