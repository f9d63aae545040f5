"""A Receiver writes a LoRA plan into a chosen slot of vLLM's LoRA layers (two NIXL agents, one process; the two slots
its destination and alternate): the slot then holds what vLLM's own PEFT-directory adapter load gives, the other slot
keeps the previous version."""

from __future__ import annotations

import pytest
import torch

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.lora_trace import enable_lora, lora_model
from weightplan.compiler.frontend.vllm_model import make_vllm_config
from weightplan.compiler.verify_lora import spec_of, vllm_slot_load, write_peft_dir
from weightplan.runtime import PlanMismatchError, Receiver, Sender, load_plan
from weightplan.runtime.lora_slots import slot_destination

from ..conftest import config_dir
from weightplan.testing.runtime_worker import byte_equal, full_weights, shard

MODEL = "engine-llama"


@pytest.fixture(scope="module")
def lora_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-slots") / "llama-lora.plan"
    compile_plan(CompileOptions(str(config_dir(MODEL)), output=out, lora="8,alpha=16,targets=down_proj+embed_tokens+gate_proj+k_proj+lm_head+o_proj+q_proj+up_proj+v_proj"))
    return load_plan(out)


def _engine_layers(plan, slots: int, max_rank: int | None = None):
    """A CPU model with vLLM's LoRA layers and `slots` slots, as an engine started with enable_lora builds it."""
    spec, targets = spec_of(plan)
    if max_rank is not None:
        spec = type(spec)(spec.rank, spec.alpha, targets, max_rank)
    config = make_vllm_config(config_dir(MODEL))
    enable_lora(config, spec, targets, slots=slots)
    _, manager = lora_model(config, device="cpu")
    return manager.modules


def _vllm_reference(plan, full, tmp_path) -> dict[str, torch.Tensor]:
    spec, targets = spec_of(plan)
    config = make_vllm_config(config_dir(MODEL))
    enable_lora(config, spec, targets)
    return vllm_slot_load(config, config, write_peft_dir(tmp_path, spec, targets, full), 0, 0)


def test_receiver_fills_chosen_slots_alternately(lora_plan, rendezvous, tmp_path):
    modules = _engine_layers(lora_plan, slots=2)
    versions = {v: full_weights(lora_plan, 0, v) for v in (1, 2)}
    tensors = {name: t.clone() for name, t in shard(lora_plan, versions[1], 0).items()}
    sender = Sender(lora_plan, 0, tensors, rendezvous=rendezvous, timeout=10, progress="thread").start()
    # One Receiver over both slots (the backend's): slot 0's views its destination, slot 1's its alternate, adjacent
    # views of the same buffers.
    receiver = Receiver(lora_plan, 0, slot_destination(lora_plan, modules, 0),
                        alternates=[slot_destination(lora_plan, modules, 1)], rendezvous=rendezvous, timeout=10,
                        derived="caller").start()
    try:
        for version, slot in ((1, 1), (2, 0)):  # version 2 into the other slot: requests on version 1 keep slot 1
            if version > 1:
                for name, t in shard(lora_plan, versions[version], 0).items():
                    tensors[name].copy_(t)
            sender.publish(version)
            receiver.sync(version, into=slot)
            assert receiver.version == version
        assert receiver.versions == (2, 1)
        for version, slot in ((1, 1), (2, 0)):
            reference = _vllm_reference(lora_plan, full_weights(lora_plan, 0, version), tmp_path / f"v{version}")
            got = slot_destination(lora_plan, modules, slot)
            assert reference.keys() == got.keys()
            assert {"model.embed_tokens.lora_a_stacked.0", "lm_head.lora_b_stacked.0"} <= got.keys()
            assert all(byte_equal(got[name], reference[name]) for name in reference), f"slot {slot} != vLLM's load"
    finally:
        receiver.close()
        sender.close()


def test_slot_destination_refuses_mismatches(lora_plan):
    modules = _engine_layers(lora_plan, slots=2)
    with pytest.raises(PlanMismatchError, match="LoRA slot 2 is out of range: the engine has 2 slots"):
        slot_destination(lora_plan, modules, 2)
    with pytest.raises(PlanMismatchError, match="plan for max_lora_rank 8"):
        slot_destination(lora_plan, _engine_layers(lora_plan, slots=1, max_rank=16), 0)
    with pytest.raises(PlanMismatchError, match="the engine has no LoRA layer"):
        slot_destination(lora_plan, {k: v for k, v in modules.items() if "o_proj" not in k}, 0)
