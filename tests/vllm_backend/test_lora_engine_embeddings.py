"""An embedding and lm_head LoRA plan written into a live CPU engine's slot: the slot's adapter id then generates what
the engine generates with the same adapter loaded by vLLM from a PEFT directory under another id (one engine).

Slow (an engine start): runs when WEIGHTPLAN_SLOW_ENGINE=1.
"""

from __future__ import annotations

import os

import pytest

from tests.support.lora_engine import compiled_lora_plan, greedy_with_lora, lora_llm, plan_into_slot, random_peft_dirs
from weightplan.testing.engines import pin_no_amx

pytestmark = pytest.mark.skipif(os.environ.get("WEIGHTPLAN_SLOW_ENGINE") != "1",
                                reason="slow engine test: set WEIGHTPLAN_SLOW_ENGINE=1")


def test_embedding_and_lm_head_plan_in_a_live_slot_generates_like_vllms_load(tmp_path, monkeypatch):
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    unpin = pin_no_amx(tmp_path)
    plan_path, plan = compiled_lora_plan(tmp_path, "8,alpha=16,targets=embed_tokens+lm_head")
    assert {d.name.rsplit(".", 2)[0] for d in plan.dests} == {"model.embed_tokens", "lm_head"}
    adapters = random_peft_dirs(plan, tmp_path, (1, 2))
    try:
        llm = lora_llm(backend=False)
        first = greedy_with_lora(llm, LoRARequest("first", 1, adapters[1]))
        expected = greedy_with_lora(llm, LoRARequest("second", 2, adapters[2]))  # vLLM's own load, into the other slot
        slot = llm.collective_rpc(plan_into_slot, args=(1, str(plan_path), adapters[2]))[0]
        updated = greedy_with_lora(llm, LoRARequest("first", 1, adapters[1]))  # id 1's slot now holds the plan's bytes
        del llm
    finally:
        unpin()
    assert slot == 0
    assert first != expected, "the two adapters generate alike: the check would prove nothing"
    assert updated == expected
