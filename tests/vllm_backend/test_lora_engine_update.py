"""The `weightplan` backend's LoRA update in a live CPU engine: a trainer publishes adapter versions through a Sender,
each update's Receiver writes one over NIXL into a free LoRA slot, and the engine then generates with that version's
adapter id exactly what a fresh engine generates with the same adapter loaded from a PEFT directory.

Slow (two engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1. Versions 1, 2 and 3 go into slots 0, 1 and 0; requests
name a version by its adapter id (= the version) and a path the engine never reads (an empty directory).
"""

from __future__ import annotations

import os

import pytest
import torch

from weightplan.testing.engines import CONFIGS, backend_info, local_shards, make_llm, pin_no_amx, shutdown

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1")
MODEL = "engine-llama"
PROMPT = [5, 9, 17, 33]
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)


def _adapter(plan, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's PEFT-named adapter tensors of one version (unit-variance, so that versions generate apart)."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in plan.sources}


def _greedy(llm, request) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0),
                       lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _slots(worker) -> list:
    return list(worker.model_runner.lora_manager._adapter_manager.lora_index_to_id)


def test_lora_versions_alternate_slots_and_generate_like_fresh_peft_engines(tmp_path):
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (tests only)
    from vllm.lora.request import LoRARequest

    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.verify_lora import spec_of, write_peft_dir
    from weightplan.runtime import load_plan
    from weightplan.vllm_backend.clients import LLMClient
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    unpin = pin_no_amx(tmp_path)
    plan_path = tmp_path / "lora.plan"
    compile_plan(CompileOptions(str(CONFIGS / MODEL), output=plan_path, lora="8,alpha=16"))
    plan = load_plan(plan_path)
    versions = {v: _adapter(plan, v) for v in (1, 2, 3)}
    unread = tmp_path / "never-read"  # the path requests carry: the backend registered the id, vLLM never loads it
    unread.mkdir()
    llm, trainer, got, reports, layouts = None, None, {}, {}, {}
    try:
        llm = make_llm(CONFIGS / MODEL, dummy=True, backend=True, **LORA)
        tensors = {name: t.clone() for name, t in local_shards(plan, versions[1], 0).items()}
        info = WeightplanTrainerInitInfo(rank=0, plan=str(plan_path), address="127.0.0.1:0", job="lora-engine", timeout=60)
        trainer = WeightplanTrainerEngine.trainer_init(info, client=LLMClient(llm), source=ShardSource(tensors))
        for v in (1, 2, 3):
            for name, value in local_shards(plan, versions[v], 0).items():
                tensors[name].copy_(value)
            trainer.send_weights(v)
            reports[v] = llm.collective_rpc(backend_info)[0]
            layouts[v] = llm.collective_rpc(_slots)[0]
            got[v] = _greedy(llm, LoRARequest(f"v{v}", v, str(unread)))
            if v == 2:  # requests on version 1 are still served, from the other slot
                got["1 after 2"] = _greedy(llm, LoRARequest("v1", 1, str(unread)))
        base = _greedy(llm, None)
    finally:
        if trainer is not None:
            trainer.shutdown()
        if llm is not None:
            shutdown(llm)
    try:
        spec, targets = spec_of(plan)
        fresh = make_llm(CONFIGS / MODEL, dummy=True, backend=False, **LORA)
        expected = {v: _greedy(fresh, LoRARequest(f"peft{v}", 10 + v,
                                                  str(write_peft_dir(tmp_path / f"peft{v}", spec, targets, versions[v]))))
                    for v in (1, 2, 3)}
        fresh_base = _greedy(fresh, None)
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
