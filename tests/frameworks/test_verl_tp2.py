"""verl's Ray `CheckpointEngineManager` syncing a tensor_parallel_size=2 rollout replica through weightplan.

Slow (a tp=2 engine, then a tp=2 reference engine, four vLLM worker processes in all): runs when
WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`). testing/verl_ray.py with `--tp 2 --replicas 1`: the replica's two
`CheckpointEngineWorker`s are one replica to our `build_topology` (the first drives the engine's pull, the second
only iterates), the plan is compiled for `tp=2`, and each of the engine's two workers reads its own shards. After
each of two steps both workers hold that step's version (staged); after the last, the engine generates the tokens
and logprobs of a fresh tp=2 engine loaded from that step's checkpoint.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("verl")
pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
STEPS = 2


def test_verl_manager_syncs_a_tp2_replica(tmp_path):
    from weightplan.testing.engines import pin_no_amx
    from weightplan.testing.verl_ray import run_manager

    unpin = pin_no_amx(tmp_path)
    try:
        stdout = run_manager(tmp_path, "--tp", "2", "--replicas", "1", "--check", "--steps", str(STEPS))[0]
    finally:
        unpin()
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert [e["global_steps"] for e in events if e["event"] == "step"] == [[s] for s in range(1, STEPS + 1)]
    assert events[-1]["tp"] == 2 and events[-1]["calls"][0]["collective_rpc:update_weights"] == STEPS
    greedy = []
    for step in range(1, STEPS + 1):
        found = json.loads((tmp_path / f"step-{step}-replica-0.json").read_text())
        assert sorted((w["rank"], w["mode"], w["version"]) for w in found["workers"]) == \
            [(0, "staged", step), (1, "staged", step)], found["workers"]
        greedy.append(found["greedy"])
    assert greedy[0] != greedy[-1], "the two steps' weights must generate differently"
    assert greedy[-1] == json.loads((tmp_path / "reference.json").read_text())["greedy"]
