"""The `weightplan` backend's LoRA update in a live CPU engine: a trainer publishes adapter versions through a Sender,
each update's Receiver writes one over NIXL into a free LoRA slot, and the engine then generates with that version's
adapter id exactly what a fresh engine generates with the same adapter loaded from a PEFT directory.

Slow (two engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1. Versions 1, 2 and 3 go into slots 0, 1 and 0; requests
name a version by its adapter id (= the version) and a path the engine never reads (an empty directory).
"""

from __future__ import annotations

import os

import pytest

from tests.support.lora_engine import compiled_lora_plan, greedy_with_lora, lora_llm, random_adapter
from weightplan.testing.engines import backend_info, local_shards, pin_no_amx, shutdown

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1")


def _slots(worker) -> list:
    return list(worker.model_runner.lora_manager._adapter_manager.lora_index_to_id)


def test_lora_versions_alternate_slots_and_generate_like_fresh_peft_engines(tmp_path):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    from vllm.lora.request import LoRARequest

    from weightplan.compiler.verify_lora import spec_of, write_peft_dir
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    unpin = pin_no_amx(tmp_path)
    plan_path, plan = compiled_lora_plan(tmp_path, "8,alpha=16")
    versions = {v: random_adapter(plan, v) for v in (1, 2, 3)}  # the trainer's PEFT-named tensors
    unread = tmp_path / "never-read"  # the path requests carry: the backend registered the id, vLLM never loads it
    unread.mkdir()
    llm, trainer, got, reports, layouts = None, None, {}, {}, {}
    try:
        llm = lora_llm(backend=True)
        tensors = {name: t.clone() for name, t in local_shards(plan, versions[1], 0).items()}
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="lora-engine", timeout=60)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(tensors))
        for v in (1, 2, 3):
            for name, value in local_shards(plan, versions[v], 0).items():
                tensors[name].copy_(value)
            trainer.send_weights(v)
            reports[v] = llm.collective_rpc(backend_info)[0]
            layouts[v] = llm.collective_rpc(_slots)[0]
            got[v] = greedy_with_lora(llm, LoRARequest(f"v{v}", v, str(unread)))
            if v == 2:  # requests on version 1 are still served, from the other slot
                got["1 after 2"] = greedy_with_lora(llm, LoRARequest("v1", 1, str(unread)))
        base = greedy_with_lora(llm, None)
    finally:
        if trainer is not None:
            trainer.shutdown()
        if llm is not None:
            shutdown(llm)
    try:
        spec, targets = spec_of(plan)
        fresh = lora_llm(backend=False)
        peft_dirs = {v: str(write_peft_dir(tmp_path / f"peft{v}", spec, targets, versions[v])) for v in (1, 2, 3)}
        expected = {v: greedy_with_lora(fresh, LoRARequest(f"peft{v}", 10 + v, peft_dirs[v])) for v in (1, 2, 3)}
        fresh_base = greedy_with_lora(fresh, None)
        shutdown(fresh)
    finally:
        unpin()
    assert len({str(expected[v]) for v in (1, 2, 3)} | {str(fresh_base)}) == 4, "versions must generate apart"
    assert base == fresh_base, "dummy base weights differ between the two engines: the comparison would be meaningless"
    assert [(reports[v]["slot"], reports[v]["lora_id"], reports[v]["displaced_lora_id"]) for v in (1, 2, 3)] == \
        [(0, 1, None), (1, 2, None), (0, 3, 1)], reports
    assert [layouts[v] for v in (1, 2, 3)] == [[1, None], [1, 2], [3, 2]]
    assert len({reports[v]["incarnation"] for v in (1, 2, 3)}) == 1, "every update must reuse the Receiver joined at init"
    assert got[1] == expected[1] and got[2] == expected[2] and got[3] == expected[3]
    assert got["1 after 2"] == expected[1]
