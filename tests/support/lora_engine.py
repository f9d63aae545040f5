"""LoRA in live CPU engines for the tests: the plan and the engine, random adapters, a plan run into a slot, tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from weightplan.testing.engines import CONFIGS, make_llm

MODEL = "engine-llama"
PROMPT = [5, 9, 17, 33]
LORA_ENGINE = dict(enable_lora=True, max_loras=2, max_lora_rank=8)  # two slots, rank up to 8


def compiled_lora_plan(directory: Path, lora: str):
    """MODEL's LoRA plan (`compile-plan --lora LORA`) written to directory/lora.plan: (its path, the loaded plan)."""
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import load_plan

    path = directory / "lora.plan"
    compile_plan(CompileOptions(str(CONFIGS / MODEL), output=path, lora=lora))
    return path, load_plan(path)


def lora_llm(*, backend: bool):
    """A live CPU engine of MODEL (dummy weights) with LORA_ENGINE's slots; `backend`: the weightplan backend too."""
    return make_llm(CONFIGS / MODEL, dummy=True, backend=backend, **LORA_ENGINE)


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


def random_adapter(plan, seed: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Unit-variance tensors for the plan's sources (so that adapters of different seeds generate apart), in `dtype`
    (default each source's own)."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(dtype or getattr(torch, s.dtype)) for s in plan.sources}


def random_peft_dirs(plan, directory: Path, seeds) -> dict[int, str]:
    """seed -> a PEFT directory of random bf16 tensors for the plan's sources, its config from the plan header."""
    from weightplan.compiler.verify_lora import spec_of, write_peft_dir

    spec, targets = spec_of(plan)
    return {seed: str(write_peft_dir(directory / f"adapter{seed}", spec, targets,
                                     random_adapter(plan, seed, torch.bfloat16)))
            for seed in seeds}


def greedy_with_lora(llm, request, prompt: list[int] = PROMPT) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=8, temperature=0.0),
                       lora_request=request, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
