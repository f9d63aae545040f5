"""The weightplan backend in a data_parallel_size=2 vLLM CPU engine (AsyncLLM): one update with a dp=2 plan.

Slow (two dp=2 engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`). `vllm.LLM`
refuses data_parallel_size > 1 in one process, so the engine is an AsyncLLM (two engine cores, one worker each,
plan ranks 0 and 1). Greedy outputs are taken on each DP rank and compared with a fresh dp=2 AsyncLLM loaded
from a checkpoint of the same weights.
"""

from __future__ import annotations

import os

import pytest

from weightplan.testing.engines import (
    CONFIGS, AsyncEngine, async_greedy, local_shards, pin_no_amx, plan_and_checkpoint, two_worker_cpu_bind,
)

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
# A dense model: with data parallelism vLLM runs MoE layers through its naive DP dispatch
# (fused_moe/prepare_finalize/naive_dp_ep.py), which needs all_gatherv, and the CPU communicator does not
# implement it: a dp=2 Qwen3-MoE CPU engine starts, then dies at its first generation (docs/vllm.md).
MODEL = os.environ.get("WEIGHTPLAN_DP2_MODEL", "engine-llama")


def per_rank(served: AsyncEngine) -> list:
    return [served.run(async_greedy(served.engine, data_parallel_rank=r)) for r in (0, 1)]


@pytest.mark.parametrize("inference", ["tp=1,dp=2", "tp=1,dp=2,gpus-per-node=2"], ids=["plain", "fanout"])
def test_one_update_of_a_dp2_cpu_engine(tmp_path, monkeypatch, inference):
    """With `gpus-per-node=2` both DP ranks share a node: each replicated entry is pulled by one engine worker and read
    from it by the other (second hops between the two engine cores' receivers)."""
    from weightplan.vllm_backend.clients import AsyncLLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", two_worker_cpu_bind())
    unpin = pin_no_amx(tmp_path)
    try:
        plan_path, plan, full, checkpoint = plan_and_checkpoint(MODEL, tmp_path, inference)
        served = AsyncEngine(CONFIGS / MODEL, dummy=True, backend=True, data_parallel_size=2)
        trainer = None
        try:
            cold = per_rank(served)
            info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="dp2", timeout=60)
            trainer = WeightplanTrainerEngine.trainer_init(info, client=AsyncLLMClient(served.engine, served.loop),
                                                           source=ShardSource(local_shards(plan, full, 0)))
            trainer.send_weights()
            out = per_rank(served)
        finally:
            if trainer is not None:
                trainer.shutdown()
                trainer = None
            served.close()
        reference = AsyncEngine(checkpoint, dummy=False, backend=False, data_parallel_size=2)
        try:
            expected = per_rank(reference)
        finally:
            reference.close()
        assert cold != expected, "the dummy engine already generates the reference"
        assert out == expected, "the dp=2 engine differs from a fresh dp=2 engine on the checkpoint"
    finally:
        unpin()
