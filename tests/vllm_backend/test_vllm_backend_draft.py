"""The weightplan backend updates the MTP draft of a live vLLM CPU engine with speculative decoding on (slow)."""

from __future__ import annotations

import os

import pytest

from weightplan.testing.engines import (
    backend_info, CONFIGS, draft_kernel_digests, full_weights, greedy, kernel_digests, local_shards, make_llm, pin_no_amx,
    shutdown, write_checkpoint,
)

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1 (make test-engine-slow)")
MODEL = "engine-deepseek-v3-mtp"
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _digests(llm) -> dict:
    """The kernel digests of draft and target, without the KV caches (what ran before, not weights)."""
    both = {"draft": llm.collective_rpc(draft_kernel_digests)[0], "target": llm.collective_rpc(kernel_digests)[0]}
    return {side: {k: v for k, v in d.items() if not k.endswith(".kv_cache")} for side, d in both.items()}


def test_draft_weights_of_a_live_mtp_engine_follow_an_update(tmp_path):
    """Slow (three engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1 (`make test-engine-slow`).

    A tiny DeepSeek-V3-shaped MLA model with one MTP layer (tests/configs/engine-deepseek-v3-mtp) is
    served with MTP speculative decoding and dummy weights. One trainer rank (this process) drives it
    through the trainer engine with a draft plan: each `send_weights` updates the target, then the
    draft (a second Sender in job `<job>.draft`, vLLM's `start_draft_weight_update`), twice with
    different weights. After each, the tensors the draft's and the target's kernels use, and greedy
    tokens and logprobs, equal those of a fresh engine loaded from a checkpoint of the same weights
    (the target's tensors plus the MTP layer `model.layers.3.*`).
    """
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
        # the trainer's own tensors (one rank holds whole tensors: local_shards would alias `weights`)
        shards = {k: v.clone() for k, v in local_shards(plan, weights[1][0], 0).items()}
        draft_shards = {k: v.clone() for k, v in local_shards(draft_plan, weights[1][1], 0).items()}

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
            ours[version], outs[version], reports[version] = _digests(llm), greedy(llm), llm.collective_rpc(backend_info)[0]
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
            diffs = {side: sorted(k for k in set(theirs[side]) | set(ours[version][side])
                                  if ours[version][side].get(k) != theirs[side].get(k)) for side in ("draft", "target")}
            unchanged = sorted(k for k in diffs["draft"] if ours[version]["draft"].get(k) == dummy["draft"].get(k))
            assert diffs == {"draft": [], "target": []}, (version, {k: (len(v), v[:12]) for k, v in diffs.items()}, unchanged[:12])
            assert outs[version] == expected
        assert ours[1]["draft"] != ours[2]["draft"]
    finally:
        unpin()
