"""The weightplan backend updating the MTP draft of a live vLLM CPU engine with speculative decoding on.

Slow (two engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`). A tiny
DeepSeek-V3-shaped MLA model with one MTP layer (`tests/configs/engine-deepseek-v3-mtp`) is served
with `speculative_config={"method": "mtp"}` and dummy weights; one trainer rank (this process)
drives the engine through the trainer engine with a draft plan: each `send_weights` updates the
target, then the draft (a second Sender in job `<job>.draft`, vLLM's `start_draft_weight_update`),
twice with different weights. After each, the tensors the draft's and
the target's kernels use equal those of a fresh engine loaded from a checkpoint of the same
weights (target tensors plus the MTP layer `model.layers.3.*`), and so do greedy tokens and logprobs.
"""

from __future__ import annotations

import os

import pytest

from tests.vllm_engine_support import (
    CONFIGS, draft_kernel_digests, full_weights, greedy, kernel_digests, local_shards, make_llm, pin_no_amx, shutdown,
    write_checkpoint,
)

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
MODEL = "engine-deepseek-v3-mtp"
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _info(worker) -> dict:
    return worker.weight_transfer_engine.info()


def _digests(llm) -> dict:
    return {"draft": llm.collective_rpc(draft_kernel_digests)[0], "target": llm.collective_rpc(kernel_digests)[0]}


def test_draft_weights_of_a_live_mtp_engine_follow_an_update(tmp_path):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import load_plan
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    unpin = pin_no_amx(tmp_path)
    try:
        config = CONFIGS / MODEL
        plan_path = compile_plan(CompileOptions(model=str(config), output=tmp_path / "target.plan")).path
        draft_path = compile_plan(CompileOptions(model=str(config), output=tmp_path / "draft.plan", draft=True)).path
        plan, draft_plan = load_plan(plan_path), load_plan(draft_path)
        weights = {v: (full_weights(plan, 0, v), full_weights(draft_plan, 0, v)) for v in (1, 2)}
        shards = local_shards(plan, weights[1][0], 0)
        draft_shards = local_shards(draft_plan, weights[1][1], 0)

        llm = make_llm(config, dummy=True, backend=True, speculative_config=MTP)
        dummy = _digests(llm)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="mtp", timeout=60, verify=True,
                                         draft_plan=str(draft_path))
        trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(shards),
                                                       draft_source=ShardSource(draft_shards))
        ours, outs, reports = {}, {}, {}
        for version in (1, 2):
            for mine, full, p in ((shards, weights[version][0], plan), (draft_shards, weights[version][1], draft_plan)):
                for name, value in local_shards(p, full, 0).items():
                    mine[name].copy_(value)
            trainer.send_weights(version)
            ours[version], outs[version], reports[version] = _digests(llm), greedy(llm), llm.collective_rpc(_info)[0]
        trainer.shutdown()
        shutdown(llm)
        for version, report in reports.items():
            assert report["draft"]["version"] == version and report["draft"]["mode"] == "staged", report
            assert report["version"] == version, report

        for version in (1, 2):
            checkpoint = write_checkpoint(config, {**weights[version][0], **weights[version][1]}, tmp_path / f"ckpt{version}")
            reference = make_llm(checkpoint, dummy=False, backend=False, speculative_config=MTP)
            theirs, expected = _digests(reference), greedy(reference)
            shutdown(reference)
            assert dummy["draft"] != theirs["draft"], "the dummy draft already holds the checkpoint's weights"
            for side in ("draft", "target"):
                differ = sorted(k for k in theirs[side] if ours[version][side].get(k) != theirs[side][k])
                assert not differ and set(ours[version][side]) == set(theirs[side]), f"v{version} {side}: {differ[:5]}"
            assert outs[version] == expected
        assert ours[1]["draft"] != ours[2]["draft"]
    finally:
        unpin()
