"""fp8_per_block plans over NIXL/UCX between processes: every sync's digests equal vLLM's own quantized load."""

from __future__ import annotations

import numpy as np

from weightplan.runtime import load_plan
from weightplan.runtime.plan.schema import GATHER, RECEIVER, SENDER

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job
from ..support.fp8 import CASES

VERSIONS = (1, 2)


def test_fp8_syncs_match_vllm_online_quantization(plan_cache, tmp_path):
    """All fp8 cases in one set of processes (4 trainers, 2 inference ranks), each case synced twice with new weights:
    shards aligned to 128 rows (sender-side blocks; the fused tensor fed by two trainer ranks), unaligned (receiver-side
    blocks), mixed stacked experts over EP with DP attention, DeepSeek-V3 shapes under TP=2 with padded experts, and
    unaligned shards replicated on two inference ranks (gather-side blocks: one trainer reads its peers' bf16)."""
    cases = sorted(CASES)
    plans = {c: plan_cache(CASES[c][0], CASES[c][1], "bf16", CASES[c][2], CASES[c][3], quant="fp8_per_block") for c in cases}
    loaded = {c: load_plan(plans[c]) for c in cases}
    sides = {c: set(loaded[c].spans["side"].tolist()) for c in cases}
    assert sides["aligned"] == {SENDER, RECEIVER} and sides["unaligned"] >= {RECEIVER}
    assert sides["deepseek"] == sides["gathered"] == {SENDER, RECEIVER, GATHER}  # (deepseek: fsdp=3, TP=2)
    jobs = [f"fp8-{c}" for c in cases]
    args = ["--versions", ",".join(map(str, VERSIONS)), "--timeout", "120", "--group-bytes", str(1 << 20)]
    n_src = max(p.header.src_ranks for p in loaded.values())
    n_dst = max(p.header.dst_ranks for p in loaded.values())
    with Job(tmp_path, ",".join(str(plans[c]) for c in cases), ",".join(jobs)) as job:
        models = ",".join(str(config_dir(CASES[c][0])) for c in cases)
        for k in range(n_dst):
            job.start(f"inf{k}", "inference", k, *args, "--model", models, "--verify")
        for r in range(n_src):
            job.start(f"tr{r}", "trainer", r, *args, "--digests", "--wait-joined")
        for case, name in zip(cases, jobs):
            plan = loaded[case]
            for version in VERSIONS:
                for k in range(plan.header.dst_ranks):
                    e = job.event(f"inf{k}", "synced", version, timeout=400, job=name)
                    assert e["reported"] == version, (case, e)
                    assert e["digests"] > 0 and e["n_differ"] == 0, (case, k, e["differ"])
                    assert e["fp8"] > 0 and e["verify_seconds"] is not None
                for r in range(plan.header.src_ranks):
                    released = job.event(f"tr{r}", "released", version, job=name)
                    assert released["timed_out"] == [] and released["failed"] == [], (case, released)
                    assert released["gatherers_timed_out"] == [], (case, released)
            # The receiver stages bf16 only for its own blocks, and less than the whole staging tensors.
            staged = [job.event(f"inf{k}", "synced", VERSIONS[0], job=name)["staging_bytes"]
                      for k in range(plan.header.dst_ranks)]
            whole = 2 * sum(e.numel for e in plan.staging if 0 in e.ranks)
            has_receiver_blocks = bool(np.any(plan.spans["side"] == RECEIVER))
            assert (0 < staged[0] < whole) if has_receiver_blocks else staged[0] == 0, (case, staged, whole)
        job.assert_clean_exit()
