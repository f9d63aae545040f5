"""LoRA adapters in live CPU engines for the tests: random PEFT directories, a plan executed into a slot, greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

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


def greedy_with_lora(llm, request, prompt: list[int] = PROMPT) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0),
                       lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
