"""TRL's VLLMGeneration synced by weightplan: 4 FSDP2 (dp_shard=2, ep=2) trainer ranks, each with its colocated vLLM CPU engine.

Three steps; after each, rank 0's engine holds (in the loader layout it rebuilt its kernels from) exactly what vLLM's
own load_weights makes of the trainers' gathered state, digest by digest, and every rank's engine generates the tokens
and logprobs a fresh engine loaded from that state's checkpoint generates.
"""

from __future__ import annotations

import json

from weightplan.testing.trl_worker import WORLD, run_trainers
from weightplan.testing.engines import pin_no_amx, read_references, start_references

STEPS = 3


def test_trl_colocate_three_steps_equal_vllm_load_and_fresh_engines(tmp_path):
    unpin = pin_no_amx(tmp_path)
    try:
        run_trainers(tmp_path, "--check", "--steps", str(STEPS))
        refs = start_references({s: tmp_path / f"checkpoint-{s}" for s in range(1, STEPS + 1)}, tmp_path / "refs.json",
                                tmp_path / "refs.log")
        refs = read_references(refs, tmp_path / "refs.json", tmp_path / "refs.log")
    finally:
        unpin()
    outputs = []
    for step in range(1, STEPS + 1):
        ours = [json.loads((tmp_path / f"step-{step}-rank-{r}.json").read_text()) for r in range(WORLD)]
        assert ours[0]["digests"] > 0 and ours[0]["digests_differ"] == [], (step, ours[0]["digests_differ"][:5])
        expected = refs[step]
        for r, out in enumerate(ours):
            assert out["greedy"] == [list(p) for p in expected], (step, r)
        outputs.append(json.dumps(expected))
    assert len(set(outputs)) == STEPS, "the three steps' weights must generate differently"
