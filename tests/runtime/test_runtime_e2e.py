"""End to end over real NIXL/UCX between processes: FSDP trainers (fp32 masters) to vLLM models, three syncs,
derived MLA state recomputed after each."""

from __future__ import annotations

import pytest

from ..conftest import config_dir
from ..support.runtime_harness import Job

VERSIONS = (1, 2, 3)


@pytest.mark.parametrize("inference", ["dp=2,ep", "tp=2"])
def test_three_syncs_match_vllm_load_of_the_fp32_masters(plan_cache, tmp_path, inference):
    plan = plan_cache("tiny-glm", "hf", "fp32", "fsdp=4", inference)
    versions = ",".join(map(str, VERSIONS))
    with Job(tmp_path, plan, f"e2e-{inference.replace(',', '-').replace('=', '')}") as job:
        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--versions", versions, "--model", str(config_dir("tiny-glm")),
                      "--verify", "--timeout", "60")
        for r in range(4):
            job.start(f"tr{r}", "trainer", r, "--versions", versions, "--digests", "--wait-joined", "--timeout", "60")
        for version in VERSIONS:
            for k in range(2):
                e = job.event(f"inf{k}", "synced", version)
                assert e["reported"] == version
                assert e["digests"] > 0 and e["n_differ"] == 0, e["differ"]
                # MLA's W_UK_T/W_UV, which vLLM derives from kv_b_proj, are compared too: refreshed, not stale
                assert e["absorbed"] == 2 * 5, e
                assert e["verify_seconds"] is not None
            for r in range(4):
                released = job.event(f"tr{r}", "released", version)
                assert released["timed_out"] == [] and released["failed"] == []
                assert released["acked"], "every trainer rank serves some inference rank"
        job.assert_clean_exit()
