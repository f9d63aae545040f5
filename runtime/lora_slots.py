"""A LoRA plan's destination in a model with vLLM's LoRA layers: one chosen slot of every `lora_{a,b}_stacked` buffer."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from .errors import PlanMismatchError
from .plan.format import Plan

_DEST = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_a_stacked|lora_b_stacked)\.(?P<slice>\d+)$")


def stacked_slices(module, kind: str) -> tuple[torch.Tensor, ...]:
    """A `*WithLoRA` layer's `lora_a_stacked` / `lora_b_stacked` as a tuple of slices: linear layers keep one tensor per
    packed slice, embeddings and the LM head (`VocabParallelEmbeddingWithLoRA`, `LogitsProcessorWithLoRA`) a bare
    tensor, which is their one slice."""
    buffers = getattr(module, kind, ())
    return (buffers,) if isinstance(buffers, torch.Tensor) else tuple(buffers)


def slot_destination(plan: Plan, modules: Mapping[str, object], slot: int) -> dict[str, torch.Tensor]:
    """Plan destination name -> the `slot`-th slot (a contiguous `[slot:slot+1]` view) of that module's stacked buffer.

    `modules` maps module names to vLLM's `*WithLoRA` layers (a LoRA model manager's `modules`); the plan's
    destinations have the shape of a one-slot buffer, so the engine's max_lora_rank and targets must be the plan's.
    """
    lora = plan.header.inference.lora
    if lora is None:
        raise PlanMismatchError("not a LoRA plan (compile it with compile-plan --lora)")
    out = {}
    for entry in plan.dests:
        match = _DEST.match(entry.name)
        if match is None:
            raise PlanMismatchError(f"LoRA plan destination {entry.name!r} is not <module>.lora_{{a,b}}_stacked.<slice>")
        module = modules.get(match["module"])
        if module is None:
            raise PlanMismatchError(f"the engine has no LoRA layer {match['module']!r} (plan targets {', '.join(lora.targets)}; "
                                    "start it with the same --lora-target-modules)")
        buffers = stacked_slices(module, match["kind"])
        index = int(match["slice"])
        if index >= len(buffers):
            raise PlanMismatchError(f"{entry.name}: the engine's {match['module']} has {len(buffers)} slices")
        buffer = buffers[index]
        if not 0 <= slot < buffer.shape[0]:
            raise PlanMismatchError(f"LoRA slot {slot} is out of range: the engine has {buffer.shape[0]} slots (max_loras)")
        view = buffer[slot:slot + 1]
        if tuple(view.shape) != entry.shape or str(view.dtype).removeprefix("torch.") != entry.dtype:
            raise PlanMismatchError(f"{entry.name}: the engine's slot is {tuple(view.shape)} {view.dtype}, the plan's "
                                    f"{entry.shape} {entry.dtype} (plan for max_lora_rank {lora.max_rank}; start the engine "
                                    "with the same --max-lora-rank and dtype)")
        out[entry.name] = view
    return out
