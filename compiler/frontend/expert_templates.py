"""Trace three routed experts of each MoE layer through vLLM and derive the others' loads from the first two (guarded).

A rank of GLM-5.2 at `tp=8` holds a TP slice of all 256 experts of each MoE layer: feeding their
768 checkpoint names per traced layer through vLLM's loader (`load_weights` matches each against
every expert mapping, then `RoutedExperts.weight_loader`) was most of a rank's trace. A layer's
i-th local expert loads as its first does, with every integer moved i steps (frontend/extrapolate.py).
So for each MoE layer and checkpoint suffix (`gate_proj.weight`, ...) with at least 4 local experts,
only the first two local experts (the templates) and the last (the guard) are fed; the others are
derived. Guards, each falling back to tracing every name for real:

- the guard expert's traced assignments equal its derivation from the templates;
- the traced assignments are, in order, the traced names' blocks in the order the names were
  streamed (each checkpoint name's writes happen while it is loaded), so putting the derived
  names' blocks in their stream places gives the list a full trace gives.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ..ir import Assignment
from .extrapolate import Line, NotAffine
from .vllm_model import EXPERT_NAME, eplb_enabled, expert_maps


MIN_LOCAL_EXPERTS = 4  # with fewer, the two templates and the guard are all of them


class ExpertTemplates:
    """Which checkpoint names of `model`'s routed experts are derived rather than fed, and their derivation."""

    def __init__(self, model: torch.nn.Module):
        self.local: dict[str, list[int]] = {}  # layer prefix -> the global ids of its local experts, ascending
        # Under EPLB the expert map indexes physical slots (a logical expert may fill several), while checkpoint names
        # carry logical ids: nothing is derived, every name is fed.
        for layer, (count, expert_map) in ({} if eplb_enabled(model) else expert_maps(model)).items():
            experts = list(range(count)) if expert_map is None else [e for e, slot in enumerate(expert_map) if slot >= 0]
            if len(experts) >= MIN_LOCAL_EXPERTS:
                self.local[layer] = experts
        self.position = {layer: {e: i for i, e in enumerate(experts)} for layer, experts in self.local.items()}
        self.names_derived = 0  # checkpoint names derived in traces that passed their guards

    def derived(self, name: str) -> bool:
        """Whether `name` is a local expert's checkpoint name between a layer's templates and its guard."""
        match = EXPERT_NAME.match(name)
        if match is None or match["layer"] not in self.local:
            return False
        i = self.position[match["layer"]].get(int(match["expert"]))
        return i is not None and 1 < i < len(self.local[match["layer"]]) - 1

    def complete(self, traced: list[Assignment], names: list[str], skipped: set[str]) -> list[Assignment] | None:
        """The assignments of loading every name in `names` from those of the fed ones (`skipped` were not fed), or None
        if a guard fails."""
        blocks: dict[str, list[Assignment]] = {}
        for k, a in enumerate(traced):
            block = blocks.get(a.loading)
            if block is None:
                block = blocks[a.loading] = []
            elif block[-1] is not traced[k - 1]:  # this name's writes are not contiguous
                return None
            block.append(a)
        in_order = [a for name in names if name not in skipped for a in blocks.get(name, ())]
        if len(in_order) != len(traced) or any(x is not y for x, y in zip(in_order, traced)):
            return None
        groups: dict[tuple[str, str], list[tuple[int, str]]] = defaultdict(list)
        for name in skipped:
            match = EXPERT_NAME.match(name)
            groups[match["layer"], name[match.end():]].append((self.position[match["layer"]][int(match["expert"])], name))
        for (layer, suffix), members in groups.items():
            experts = self.local[layer]
            first, second, guard = (blocks.get(f"{layer}.experts.{e}.{suffix}") for e in (experts[0], experts[1], experts[-1]))
            if first is None or second is None or guard is None:
                return None
            try:
                line = Line(first, second)
                if line(len(experts) - 1) != guard:
                    return None
                for i, name in members:
                    blocks[name] = line(i)
            except NotAffine:
                return None
        return [a for name in names for a in blocks.get(name, ())]
