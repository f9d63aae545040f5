"""verl's checkpoint-engine sync through weightplan: 4 FSDP2 (dp_shard=2, ep=2) actor ranks, two vLLM CPU rollout replicas.

The run is bench_frameworks.py's smoke run (tests/support/framework_runs.py), shared with its smoke test.
verl's own classes run the sync over a local Ray cluster (testing/verl_ray.py says which, and what stands in for what
cannot run here): `CheckpointEngineManager.update_weights` over verl's `RayWorkerGroup`s, the engine built from
`backend: weightplan` + `custom_backend_module: weightplan.adapters.verl`, the actors stepping through verl's
`ActorRolloutRefWorker.update_weights` over verl's FSDP `get_per_tensor_param()`, the rollout through verl's
`CheckpointEngineWorker.update_weights`, whose leader drives the vLLM server actor by its Ray name. Three steps; after
each, each replica's engine holds (in the loader layout it rebuilt its kernels from) exactly what vLLM's own load_weights
makes of the actors' gathered state, digest by digest, and generates the tokens and logprobs a fresh engine loaded
from that state's checkpoint generates.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verl")

from ..support.framework_runs import STEPS  # noqa: E402


@pytest.mark.extended  # checks the framework benchmark's smoke run: make test-extended
def test_verl_three_steps_equal_vllm_load_and_fresh_engine(framework_runs):
    run, refs = framework_runs.runs["verl"], framework_runs.references["verl"]
    events = [json.loads(line) for line in (run / "driver.out").read_text().splitlines() if line.startswith("{")]
    steps, done = [e for e in events if e["event"] == "step"], events[-1]
    replicas = done["replicas"]
    assert replicas == 2
    assert [e["yielded"] for e in steps] == [[0] * replicas] * STEPS  # nothing went through verl's full-tensor path
    assert [e["global_steps"] for e in steps] == [[s] * replicas for s in range(1, STEPS + 1)]  # the adapter's tag
    # verl's manager ran its whole round every step on every replica; each engine was initialised once, pulled per step
    for calls in done["calls"]:
        for call in ("abort_all_requests", "release_kv_cache", "resume_kv_cache", "resume_generation",
                     "clear_kv_cache", "collective_rpc:start_weight_update", "collective_rpc:update_weights",
                     "collective_rpc:finish_weight_update"):
            assert calls.get(call) == STEPS, (call, calls)
        assert calls.get("collective_rpc:init_weight_transfer_engine") == 1, calls
    outputs = []
    for step in range(1, STEPS + 1):
        for replica in range(replicas):
            ours = json.loads((run / f"step-{step}-replica-{replica}.json").read_text())
            assert ours["digests"] > 0 and ours["digests_differ"] == [], (step, replica, ours["digests_differ"][:5])
            assert ours["greedy"] == [list(p) for p in refs[step]], (step, replica)
        outputs.append(json.dumps(refs[step]))
    assert len(set(outputs)) == STEPS, "the three steps' weights must generate differently"


def test_verl_resolves_the_backend_and_refuses_bad_input(tmp_path):
    from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
    from verl.workers.config import CheckpointEngineConfig

    from weightplan.adapters.verl import WeightplanCheckpointEngine, actor_shards

    config = CheckpointEngineConfig(backend="weightplan", custom_backend_module="weightplan.adapters.verl")
    assert CheckpointEngineManager(config, actor_wg=None, replicas=[]).backend_cls is WeightplanCheckpointEngine
    with pytest.raises(ValueError, match="Checkpoint engine weightplann not registered"):
        CheckpointEngineRegistry.get("weightplann")
    with pytest.raises(ValueError, match=r"unknown weightplan checkpoint-engine setting\(s\) \['plann'\]"):
        CheckpointEngineRegistry.new("weightplan", bucket_size=1, is_master=True, plann="x")
    with pytest.raises(TypeError, match="cannot find them behind list"):
        actor_shards([("w", None)])
    actor = CheckpointEngineRegistry.new("weightplan", bucket_size=1, is_master=True, plan=str(tmp_path / "none.plan"),
                                         timeout=5)
    rollout = CheckpointEngineRegistry.new("weightplan", bucket_size=1)
    kwargs = WeightplanCheckpointEngine.build_topology(1, 1, [actor.prepare(), rollout.prepare()])
    actor.init_process_group(**{k: v[0] for k, v in kwargs[0].items()})
    import torch

    with pytest.raises(FileNotFoundError, match="none.plan does not exist"):
        actor._start_trainer_engines({"w": torch.zeros(1)})
    from types import SimpleNamespace

    server = SimpleNamespace(llm=SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=SimpleNamespace(
        weight_transfer_config=SimpleNamespace(backend="nccl")))))
    with pytest.raises(RuntimeError, match="runs weight-transfer backend 'nccl'; start it with"):
        rollout._init_engine(server)
    actor.store = None


@pytest.mark.parametrize("record", [{}, {"plan": 5}, {"plan": ""}, {"plan": ["a.plan"]}, {"plan": "a.plan", "more": 1}])
def test_a_bad_plan_record_is_one_error_naming_the_key(record):
    """The rollout reads the plan path the master trainer put under PLAN_KEY: anything else there is one SyncError naming
    the key and what it holds (it was a KeyError, or a TypeError further on)."""
    from types import SimpleNamespace

    from verl.checkpoint_engine import CheckpointEngineRegistry

    from weightplan.adapters.verl import PLAN_KEY, WeightplanCheckpointEngine
    from weightplan.runtime import SyncError

    actor = CheckpointEngineRegistry.new("weightplan", bucket_size=1, is_master=True, timeout=5)
    rollout = CheckpointEngineRegistry.new("weightplan", bucket_size=1, timeout=5)
    kwargs = WeightplanCheckpointEngine.build_topology(1, 1, [actor.prepare(), rollout.prepare()])
    rollout.init_process_group(**{k: v[0] for k, v in kwargs[1].items()})
    actor.store.put(PLAN_KEY, record)
    with pytest.raises(SyncError, match=f"rendezvous key '{PLAN_KEY}' holds .*, not {{'plan': <the compiled plan's path>}}") as err:
        rollout._init_engine(SimpleNamespace())  # an engine whose backend cannot be read in-process
    assert "\n" not in str(err.value) and not rollout.rollout_initialized
    actor.store = None
