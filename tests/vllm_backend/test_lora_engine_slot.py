"""A compiled LoRA plan written into the slot of a live CPU engine's adapter: the engine then generates what a fresh
engine generates with the new adapter loaded from a PEFT directory (`LoRARequest` with a path).

Slow (two engine starts): runs when WEIGHTPLAN_SLOW_ENGINE=1. The plan is executed inside the engine's worker by the
host executor (`collective_rpc`); test_lora_engine_update.py runs the `weightplan` backend's LoRA update (NIXL).
"""

from __future__ import annotations

import os

import pytest

from tests.support.lora_engine import compiled_lora_plan, greedy_with_lora, lora_llm, plan_into_slot, random_peft_dirs
from weightplan.testing.engines import pin_no_amx

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1")


def test_plan_written_into_a_live_slot_generates_like_a_fresh_engine(tmp_path, monkeypatch):
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    unpin = pin_no_amx(tmp_path)
    plan_path, plan = compiled_lora_plan(tmp_path, "8,alpha=16")
    adapters = random_peft_dirs(plan, tmp_path, (1, 2))
    try:
        llm = lora_llm(backend=False)
        first = greedy_with_lora(llm, LoRARequest("first", 1, adapters[1]))
        llm.collective_rpc(plan_into_slot, args=(1, str(plan_path), adapters[2]))
        updated = greedy_with_lora(llm, LoRARequest("first", 1, adapters[1]))  # same id, same slot, the plan's new bytes
        del llm
        fresh = lora_llm(backend=False)
        expected = greedy_with_lora(fresh, LoRARequest("second", 2, adapters[2]))
        del fresh
    finally:
        unpin()
    assert first != expected, "the two adapters generate alike: the check would prove nothing"
    assert updated == expected
