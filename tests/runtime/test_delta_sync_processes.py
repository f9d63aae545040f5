"""Delta syncs between processes over NIXL (UCX on loopback): node-local fan-out, where pullers take the trainers'
delta on their first hop and their node's peers keep reading whole entries from them (second hops stay full: they
are intra-node, and a peer's copy of an entry is always the puller's current one), checked against the host executor."""

from __future__ import annotations

from weightplan.runtime import load_plan
from weightplan.runtime.tables.fanout import second_hops

from weightplan.testing.runtime_harness import Job

BF16_FANOUT = ("tiny-qwen3-moe", "transformers", "bf16", "fsdp=2", "dp=4,ep,gpus-per-node=2")


def test_fanout_pullers_take_deltas_and_second_hops_stay_full(plan_cache, tmp_path, monkeypatch):
    # every delta smaller than full is taken (density 0.01 is near the host codec's crossover with loopback READs)
    monkeypatch.setenv("WEIGHTPLAN_DELTA_RATES", '{"read_gbytes_per_s": 0.001}')
    path = plan_cache(*BF16_FANOUT)
    plan = load_plan(path)
    versions = "1,2,3"
    delta = ("--delta", "0.5", "--sparse", "0.01")
    with Job(tmp_path, path, "delta-fanout") as job:
        for k in range(4):
            job.start(f"inf{k}", "inference", k, "--plain", "--versions", versions, "--verify", "--timeout", "120", *delta)
        for r in range(2):
            job.start(f"tr{r}", "trainer", r, "--versions", versions, "--digests", "--wait-joined", "--timeout", "120", *delta)
        for version in (1, 2, 3):
            for k in range(4):
                e = job.event(f"inf{k}", "synced", version)
                assert e["reported"] == version and e["n_differ"] == 0, e
                hop = sum(plan.dests[d].nbytes for ds in second_hops(plan, k).values() for d in ds)
                assert e["second_hop_bytes"] == hop > 0  # whole entries from the node's puller, every version
                assert e["took"] == ("full" if version == 1 else "delta"), e
                if version > 1:
                    full = job.event(f"inf{k}", "synced", 1)["bytes"]
                    assert 0 < e["delta_bytes"] <= e["bytes"] < 0.15 * full, e
            for r in range(2):
                released = job.event(f"tr{r}", "released", version)
                assert released["timed_out"] == [] and released["failed"] == []
        job.assert_clean_exit()
