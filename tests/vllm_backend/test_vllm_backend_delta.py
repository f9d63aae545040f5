"""Delta updates of a live vLLM CPU engine through the weightplan backend, fetched while the engine keeps serving.

One trainer rank (this process, a plan for `fsdp=1`) with `delta=0.5` drives a tiny Qwen3-MoE engine started from
dummy weights. Versions 2 and 3 change 1% of the elements of their predecessor (as an optimizer step does), so the
engine's Receiver takes them as deltas; after every update the greedy tokens and logprobs equal those of a fresh
engine loaded from a checkpoint of the same weights. A corrupted delta is refused in one line and the engine keeps
serving the previous version whole; the next version, from a receiver no longer at its base, is taken full.
"""

from __future__ import annotations

import os

import pytest

from weightplan.testing.engines import (
    backend_info, CONFIGS, greedy, local_shards, make_llm, pin_no_amx, plan_and_checkpoint, read_references, shutdown,
    sparse_step, start_references, write_checkpoint,
)

MODEL = "engine-qwen3-moe"
TIMEOUT = 60.0


def test_delta_updates_prefetched_while_serving_equal_fresh_checkpoint_engines(tmp_path):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    unpin = pin_no_amx(tmp_path)
    plan_path, plan, first, checkpoint = plan_and_checkpoint(MODEL, tmp_path)
    versions = {1: first}
    for v in (2, 3, 4):
        versions[v] = sparse_step(versions[v - 1], v)
    versions[5] = sparse_step(versions[3], 5)  # what the trainer sends after version 4 failed
    changed = sum(int((versions[2][k] != versions[1][k]).sum()) for k in first) / sum(t.numel() for t in first.values())
    assert 0.002 < changed < 0.02, changed
    checkpoints = {1: checkpoint, **{v: write_checkpoint(CONFIGS / MODEL, versions[v], tmp_path / f"ckpt-{v}") for v in (2, 3, 5)}}
    references = start_references(checkpoints, tmp_path / "refs.json", tmp_path / "refs.log")
    llm = make_llm(CONFIGS / MODEL, dummy=True, backend=True)
    trainer = None
    try:
        tensors = local_shards(plan, first, 0)
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="delta-engine",
                                         timeout=TIMEOUT, delta=0.5)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(tensors))
        refs = read_references(references, tmp_path / "refs.json", tmp_path / "refs.log")
        assert len({str(refs[v]) for v in (1, 2, 3, 5)}) == 4, "every version must generate differently"

        def send(v: int, prefetch: bool) -> dict:
            for name, value in local_shards(plan, versions[v], 0).items():
                tensors[name].copy_(value)
            trainer.send_weights(v, prefetch=prefetch)
            return llm.collective_rpc(backend_info)[0]

        reports = {}
        for v, prefetch in ((1, True), (2, True), (3, False)):
            reports[v] = send(v, prefetch)
            assert greedy(llm) == refs[v], f"version {v} differs from a fresh engine on its checkpoint"
        assert [(reports[v]["took"], reports[v]["prefetched"], reports[v]["version"]) for v in (1, 2, 3)] == \
            [("full", True, 1), ("delta", True, 2), ("delta", False, 3)], reports
        assert reports[2]["bytes"] < 0.2 * reports[1]["bytes"] and reports[2]["delta_trainers"] == [0]
        for v in (1, 2):  # prefetched: the trainer's release returned after the engine read v, so the applying call
            assert reports[v]["wait_s"] < reports[v]["transfer_s"], reports[v]  # found most of the transfer done

        publish = trainer.sender.publish

        def publish_corrupted(version: int) -> None:  # the page index changes after its SHA-256 went into the record
            publish(version)
            trainer.sender._delta.index[-1] += 1

        trainer.sender.publish = publish_corrupted
        with pytest.raises(Exception) as failure:
            send(4, True)
        trainer.sender.publish = publish
        lines = [line for line in str(failure.value).splitlines() if "page index" in line]
        assert lines and "trainer rank 0" in lines[0] and "version 4" in lines[0], str(failure.value)[-2000:]
        assert greedy(llm) == refs[3], "after a refused delta the engine must serve version 3 whole"
        assert llm.get_weight_version() == "3"
        reports[5] = send(5, True)
        assert (reports[5]["took"], reports[5]["version"]) == ("full", 5), reports[5]
        assert greedy(llm) == refs[5]
    finally:
        if references.poll() is None:
            references.kill()
        if trainer is not None:
            trainer.shutdown()
        shutdown(llm)
        unpin()
