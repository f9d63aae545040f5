"""The weightplan backend in a tensor_parallel_size=2 vLLM CPU engine: one update with a tp=2 plan.

Slow (two tp=2 engine starts, four worker processes in all): runs when WEIGHTPLAN_SLOW_ENGINE=1
(`make test-engine-slow`). The backend engine starts with dummy weights; one trainer rank (this
process) sends weight set 1 through `LLMClient`; each of the engine's two workers reads its own
shards (plan ranks 0 and 1). The reference is a fresh tp=2 engine loaded from a checkpoint of the
same weights, started after the first one is shut down (a tp=1 engine reduces in another order).
"""

from __future__ import annotations

import os

import pytest

from weightplan.testing.engines import (
    backend_info, CONFIGS, greedy, local_shards, make_llm, pin_no_amx, plan_and_checkpoint, shutdown, two_worker_cpu_bind,
)

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
MODEL = "engine-qwen3-moe"


def test_one_update_of_a_tp2_cpu_engine(tmp_path, monkeypatch):
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", two_worker_cpu_bind())
    unpin = pin_no_amx(tmp_path)
    try:
        plan_path, plan, full, checkpoint = plan_and_checkpoint(MODEL, tmp_path, "tp=2")
        llm = make_llm(CONFIGS / MODEL, dummy=True, backend=True, tensor_parallel_size=2)
        cold = greedy(llm)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="tp2", timeout=60)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm),
                                                       source=ShardSource(local_shards(plan, full, 0)))
        trainer.send_weights()
        out = greedy(llm)
        infos = llm.collective_rpc(backend_info)
        trainer.shutdown()
        shutdown(llm)
        assert sorted(i["rank"] for i in infos) == [0, 1] and {i["mode"] for i in infos} == {"staged"}, infos
        reference = make_llm(checkpoint, dummy=False, backend=False, tensor_parallel_size=2)
        expected = greedy(reference)
        shutdown(reference)
        assert cold != expected, "the dummy engine already generates the reference"
        assert out == expected, "the tp=2 engine differs from a fresh tp=2 engine on the checkpoint"
    finally:
        unpin()
