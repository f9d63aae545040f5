"""Syncs across emulated nodes (network namespaces on a bridge, UCX over TCP, the store off loopback with the job
secret): 2 trainer nodes x 2 ranks to 2 inference nodes x 2 ranks, with node-local fan-out, bf16 and fp8_per_block,
every version's digests equal to vLLM's own load."""

from __future__ import annotations

import pytest

from weightplan.runtime import load_plan
from weightplan.runtime.tables.fanout import second_hops

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
        for case, path in zip(("net-bf16", "net-fp8"), plans):
            plan = load_plan(path)
            for version in (1, 2):
                for k in range(4):
                    e = job.event(f"inf{k}", "synced", version, job=case, timeout=600)
                    assert e["reported"] == version and e["n_differ"] == 0, e
                    hop = sum(plan.dests[d].nbytes for ds in second_hops(plan, k).values() for d in ds)
                    assert e["second_hop_bytes"] == hop > 0
                for r in range(4):
                    released = job.event(f"tr{r}", "released", version, job=case, timeout=600)
                    assert released["timed_out"] == [] and released["failed"] == []
        job.assert_clean_exit(*(f"inf{k}" for k in range(4)), *(f"tr{r}" for r in range(4)))
