"""The live engine's EPLB table: which logical expert each physical slot of each MoE layer holds now."""

from __future__ import annotations

import numpy as np
import torch

from weightplan.runtime import PlanMismatchError
from weightplan.runtime.plan.header import EplbHeader


def engine_expert_map(model: torch.nn.Module, eplb: EplbHeader) -> np.ndarray:
    """[MoE layers, physical slots] logical expert ids, read from the logical-to-physical maps and replica counts that
    vLLM's EplbState shares with every MoE layer (`MixtureOfExperts.set_eplb_state`: views of its own tensors, so a
    rearrangement shows here as soon as vLLM commits it). PlanMismatchError, in one line, if the model has no EPLB state."""
    layers = list(getattr(model, "moe_layers", None) or ())
    if len(layers) != len(eplb.layers):
        raise PlanMismatchError(f"the engine's model lists {len(layers)} MoE layers (`moe_layers`); the EPLB plan has "
                                f"{len(eplb.layers)}")
    table = np.full((len(layers), eplb.physical_experts), -1, dtype=np.int64)
    for i, layer in enumerate(layers):
        state = _layer_state(layer)
        to_physical = state.logical_to_physical_map.cpu().numpy()
        replicas = state.logical_replica_count.cpu().numpy()
        for expert, count in enumerate(replicas.tolist()):
            slots = to_physical[expert, :count]
            if np.any((slots < 0) | (slots >= eplb.physical_experts)):
                raise PlanMismatchError(f"MoE layer {i}: vLLM's EPLB map puts expert {expert} in slots {slots.tolist()}, "
                                        f"outside the plan's {eplb.physical_experts}")
            table[i, slots] = expert
    return table


def _layer_state(layer: torch.nn.Module):
    """The EplbLayerState vLLM gave this MoE layer (its router's), with the maps set_eplb_state registered."""
    for owner in (layer, getattr(layer, "runner", None)):
        state = getattr(getattr(owner, "router", None), "eplb_state", None)
        if state is not None and getattr(state, "logical_to_physical_map", None) is not None:
            return state
    raise PlanMismatchError(f"MoE layer {type(layer).__name__} has no EPLB state: start the engine with --enable-eplb, "
                            "or use a plan compiled without eplb")
