"""A compiled LoRA plan written into the slot of a live CPU engine's adapter: the engine then generates what a fresh
engine generates with the new adapter loaded from a PEFT directory (`LoRARequest` with a path).

Slow (two engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1. The plan is executed inside the engine's worker by the
host executor (`collective_rpc`); test_lora_engine_update.py runs the `weightplan` backend's LoRA update (NIXL).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.vllm_engine_support import CONFIGS, make_llm, pin_no_amx

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1")
MODEL = "engine-llama"
PROMPT = [5, 9, 17, 33]


def plan_into_slot(worker, lora_id: int, plan_path: str, peft_dir: str) -> int:
    """In the engine's worker: execute the plan on the PEFT directory's tensors into the slot holding `lora_id`."""
    from safetensors.torch import load_file

    from weightplan.runtime import execute_local, load_plan
    from weightplan.runtime.lora_slots import slot_destination

    manager = worker.model_runner.lora_manager._adapter_manager
    slot = manager.lora_index_to_id.index(lora_id)
    plan = load_plan(plan_path)
    execute_local(plan, {0: load_file(str(Path(peft_dir) / "adapter_model.safetensors"))},
                  {0: slot_destination(plan, manager.modules, slot)})
    return slot


def random_peft_dirs(plan, directory: Path, seeds) -> dict[int, str]:
    """seed -> a PEFT directory of random bf16 tensors for the plan's sources, its config from the plan header."""
    from weightplan.compiler.verify_lora import spec_of, write_peft_dir

    spec, targets = spec_of(plan)
    out = {}
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        tensors = {s.name: torch.randn(s.shape, generator=g).to(torch.bfloat16) for s in plan.sources}
        out[seed] = str(write_peft_dir(directory / f"adapter{seed}", spec, targets, tensors))
    return out


def _greedy(llm, request) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0),
                       lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def test_plan_written_into_a_live_slot_generates_like_a_fresh_engine(tmp_path, monkeypatch):
    from vllm.lora.request import LoRARequest

    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import load_plan

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    unpin = pin_no_amx(tmp_path)
    plan_path = tmp_path / "lora.plan"
    compile_plan(CompileOptions(str(CONFIGS / MODEL), output=plan_path, lora="8,alpha=16"))
    adapters = random_peft_dirs(load_plan(plan_path), tmp_path, (1, 2))
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
    try:
        llm = make_llm(CONFIGS / MODEL, dummy=True, backend=False, **lora)
        first = _greedy(llm, LoRARequest("first", 1, adapters[1]))
        llm.collective_rpc(plan_into_slot, args=(1, str(plan_path), adapters[2]))
        updated = _greedy(llm, LoRARequest("first", 1, adapters[1]))  # same id, same slot, the plan's new bytes
        del llm
        fresh = make_llm(CONFIGS / MODEL, dummy=True, backend=False, **lora)
        expected = _greedy(fresh, LoRARequest("second", 2, adapters[2]))
        del fresh
    finally:
        unpin()
    assert first != expected, "the two adapters generate alike: the check would prove nothing"
    assert updated == expected
