"""End to end over real NIXL/UCX between processes: FSDP trainers (fp32 masters) to vLLM models, three syncs,
derived MLA state recomputed after each."""

from __future__ import annotations

import pytest

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job

VERSIONS = (1, 2, 3)


@pytest.mark.parametrize("inference", ["dp=2,ep", "tp=2"])
def test_three_syncs_match_vllm_load_of_the_fp32_masters(plan_cache, tmp_path, inference):
    plan = plan_cache("tiny-glm", "hf", "fp32", "fsdp=4", inference)
    with Job(tmp_path, plan, f"e2e-{inference.replace(',', '-').replace('=', '')}") as job:
        job.start_sync(str(config_dir("tiny-glm")), 2, 4, VERSIONS)
        for version in VERSIONS:
            synced, released = job.synced(2, 4, version)
            for e in synced:
                # MLA's W_UK_T/W_UV, which vLLM derives from kv_b_proj, are compared too: refreshed, not stale
                assert e["absorbed"] == 2 * 5, e
                assert e["verify_seconds"] is not None
            assert all(e["acked"] for e in released), "every trainer rank serves some inference rank"
        job.assert_clean_exit()
