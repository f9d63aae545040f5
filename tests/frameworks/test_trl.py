"""TRL's VLLMGeneration synced by weightplan: 4 FSDP2 (dp_shard=2, ep=2) trainer ranks, each with its colocated vLLM CPU engine.

The run is bench_frameworks.py's smoke run (tests/support/framework_runs.py), shared with its smoke test. Three steps;
after each, rank 0's engine holds (in the loader layout it rebuilt its kernels from) exactly what vLLM's own
load_weights makes of the trainers' gathered state, digest by digest, and every rank's engine generates the tokens and
logprobs a fresh engine loaded from that state's checkpoint generates.
"""

from __future__ import annotations

import json

import pytest

from weightplan.testing.trl_worker import WORLD

from ..support.framework_runs import STEPS


@pytest.mark.extended  # checks the framework benchmark's smoke run: make test-extended
def test_trl_colocate_three_steps_equal_vllm_load_and_fresh_engines(framework_runs):
    run, refs = framework_runs.runs["trl"], framework_runs.references["trl"]
    outputs = []
    for step in range(1, STEPS + 1):
        ours = [json.loads((run / f"step-{step}-rank-{r}.json").read_text()) for r in range(WORLD)]
        assert ours[0]["digests"] > 0 and ours[0]["digests_differ"] == [], (step, ours[0]["digests_differ"][:5])
        expected = refs[step]
        for r, out in enumerate(ours):
            assert out["greedy"] == [list(p) for p in expected], (step, r)
        outputs.append(json.dumps(expected))
    assert len(set(outputs)) == STEPS, "the three steps' weights must generate differently"
