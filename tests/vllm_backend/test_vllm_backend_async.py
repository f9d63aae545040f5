"""The weightplan backend behind an `AsyncLLM` CPU engine, driven through `clients.AsyncLLMClient`: one update.

Slow (one more engine start plus a reference engine): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`).
The AsyncLLM runs on an event loop in a helper thread, as in an RL framework's rollout server; the trainer (one
rank, this process) drives it from the test's thread with pause_generation / resume_generation around the update.
"""

from __future__ import annotations

import os

import pytest

from weightplan.testing.engines import (
    CONFIGS, AsyncEngine, async_greedy, first_reference, full_weights, local_shards, pin_no_amx, plan_and_first_reference,
)

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
MODEL = "engine-qwen3-moe"


def test_one_update_of_an_async_llm_through_async_llm_client(tmp_path):
    from weightplan.vllm_backend.clients import AsyncLLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    unpin = pin_no_amx(tmp_path)
    plan_path, plan, refs = plan_and_first_reference(MODEL, tmp_path)
    served = AsyncEngine(CONFIGS / MODEL, dummy=True, backend=True)
    trainer = None
    try:
        cold = served.run(async_greedy(served.engine))
        tensors = local_shards(plan, full_weights(plan, 0, 1), 0)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="async", timeout=60)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=AsyncLLMClient(served.engine, served.loop),
                                                       source=ShardSource(tensors))
        trainer.send_weights()
        expected = first_reference(refs, tmp_path)
        assert cold != expected, "the dummy engine already generates the reference"
        assert not served.run(served.engine.is_paused()), "AsyncLLMClient must resume generation after the update"
        assert served.run(async_greedy(served.engine)) == expected, "the AsyncLLM differs from a fresh checkpoint engine"
    finally:
        if trainer is not None:
            trainer.shutdown()
            trainer = None  # its client holds the engine
        served.close()
        unpin()
