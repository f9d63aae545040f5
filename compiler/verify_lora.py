"""verify-plan for an adapter plan: the plan's slot bytes against vLLM's own load of a PEFT directory of the same tensors."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from weightplan.runtime import execute_local
from weightplan.runtime.plan.format import Plan
from .digests import compare_digests, poisoned
from .frontend.lora_trace import LoraSpec, enable_lora, peft_config, slot_buffers


def write_peft_dir(directory: Path, spec: LoraSpec, targets: tuple[str, ...], tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT checkpoint directory (adapter_config.json + adapter_model.safetensors, PEFT's key names), as PEFT saves one."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(peft_config(spec, targets)))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "adapter_model.safetensors"))
    return directory


def spec_of(plan: Plan) -> tuple[LoraSpec, tuple[str, ...]]:
    lora = plan.header.inference.lora
    return LoraSpec(lora.rank, lora.alpha, lora.targets, lora.max_rank), lora.targets


def vllm_slot_load(vllm_config, base, peft_dir: Path, tp_rank: int, dp_rank: int, pp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The slot buffers after vLLM's WorkerLoRAManager loads `peft_dir` (LoRARequest with a path) into a CPU model of
    this rank: vLLM's own reading, packing, scaling and set_lora."""
    from vllm.config import set_current_vllm_config
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager
    from .frontend.vllm_model import build_model
    from .frontend.vllm_patches import parallel_rank

    model = build_model(vllm_config, "cpu", tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=pp_rank, base_config=base)
    with parallel_rank(vllm_config, tp_rank, dp_rank, pp_rank), set_current_vllm_config(vllm_config):
        worker = WorkerLoRAManager(vllm_config, torch.device("cpu"), getattr(model, "embedding_modules", {}))
        worker.create_lora_manager(model, vllm_config)
        worker.add_adapter(LoRARequest("reference", 1, str(peft_dir)))
    return slot_buffers(worker._adapter_manager)


def verify_lora(plan: Plan, config_dir: Path, full: dict[str, torch.Tensor], shards, chosen_names: set[str],
                ranks: set[int], make_config, log) -> tuple[int, int, list[str], list[str]]:
    """(tensors, bytes, mismatches, compared) of executing the plan into poisoned slot buffers, rank by rank,
    against vLLM's load of a PEFT directory holding `full`."""

    spec, targets = spec_of(plan)
    info = plan.header.inference
    base = make_config(config_dir)
    vllm_config = make_config(config_dir, tp=info.tp, dp=info.dp, ep=info.ep, pp=info.pp or 1) if plan.header.dst_ranks > 1 else base
    for config in {id(c): c for c in (base, vllm_config)}.values():
        enable_lora(config, spec, targets)
    tensors, nbytes, mismatches, compared = 0, 0, [], []
    with tempfile.TemporaryDirectory(prefix="weightplan-lora-") as tmp:
        peft_dir = write_peft_dir(Path(tmp) / "adapter", spec, targets, full)
        planned_of = {rank: {e.name: poisoned(e) for e in plan.dests if rank in e.ranks and e.name in chosen_names}
                      for rank in sorted(ranks)}
        execute_local(plan, shards, planned_of, only=chosen_names)
        for rank, planned in planned_of.items():
            at = info.rank_coords(rank)
            slots = vllm_slot_load(vllm_config, base, peft_dir, at.tp, at.dp, at.pp)
            differ, same = compare_digests({name: slots[name] for name in planned}, planned, rank)
            mismatches += differ
            compared += same
            tensors += len(same)
            nbytes += sum(t.numel() * t.element_size() for t in planned.values())
            log(f"inference rank {rank}: {len(same)} LoRA slot tensors compared with vLLM's adapter load")
    return tensors, nbytes, mismatches, compared
