"""Where a sync's READs land: the live parameters (direct) or buffers applied to the engine after a whole sync (staged)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from weightplan.runtime import Plan

from .engine_check import owner
from .live_patches import CONSUMED, Snapshot, method_name, post_load_step, rebuild, transforms_on

log = logging.getLogger("weightplan.vllm_backend")


@dataclass
class Destination:
    """The tensors a Receiver writes and how an update reaches the engine's kernels.

    direct: the tensors are the live parameters; nothing to apply after a sync.
    staged: the tensors are buffers registered once, shaped like vLLM's loader parameters. After
    a whole sync `apply()` rebuilds each transforming module from them (live_patches.rebuild) and
    copies the rest into the live parameters; until then the engine serves its previous weights.
    """

    mode: str
    tensors: dict[str, torch.Tensor]
    reason: str
    rebuilt: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # module name -> {attr: buffer}
    copied: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (live parameter, buffer)
    modules: dict[str, torch.nn.Module] = field(default_factory=dict)
    apply_seconds: float = 0.0

    @property
    def staging_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) if self.mode == "staged" else 0

    def apply(self) -> float:
        """Staged mode: make the engine compute with the buffers' weights; all or nothing. Returns seconds."""
        began = time.perf_counter()
        if self.mode == "staged":
            done: list[Snapshot] = []
            try:
                for module_name, tensors in self.rebuilt.items():
                    done.append(rebuild(self.modules[module_name], tensors))
            except BaseException:
                for snapshot in reversed(done):
                    snapshot.restore()
                raise
            with torch.no_grad():
                for live, buffer in self.copied:
                    live.copy_(buffer)
        self.apply_seconds = time.perf_counter() - began
        return self.apply_seconds


def _why(method: str | None, platform: str) -> str:
    if method is None:
        return "whose live tensor is not laid out as the plan's destination"
    return f"whose post-load step ({method}) {post_load_step(method, platform)}"


def choose(plan: Plan, names: list[str], model: torch.nn.Module, platform: str, requested: str) -> Destination:
    """Pick direct or staged mode for these planned parameters of the live model ("auto" decides; reported)."""
    transforming = {}
    entries = {e.name: e for e in plan.dests}
    for name in names:
        module, attr = owner(model, name)
        live = module._parameters[attr]
        entry = entries[name]
        if transforms_on(module, platform) or tuple(live.shape) != tuple(entry.shape) or not live.is_contiguous():
            transforming[name] = (type(module).__name__, method_name(module) if transforms_on(module, platform) else None)
    if requested == "direct" and transforming:
        first = next(iter(transforming.items()))
        raise ValueError(f"weightplan init_info field 'mode' is 'direct', but {len(transforming)} planned parameters are "
                         f"not what the engine's kernels use on {platform} (e.g. {first[0]} of {first[1][0]}, "
                         f"{_why(first[1][1], platform)}): use mode 'staged' or 'auto'")
    if requested == "direct" or (requested == "auto" and not transforming):
        tensors = {name: owner(model, name)[0]._parameters[owner(model, name)[1]].data for name in names}
        return Destination("direct", tensors, "every planned parameter is what the engine's kernels use")
    # Staging buffers live where the engine's parameters live (its GPU): READs land there, and applying them is a
    # device-to-device copy or rebuild.
    tensors = {name: torch.empty(entries[name].shape, dtype=getattr(torch, entries[name].dtype),
                                 device=owner(model, name)[0]._parameters[owner(model, name)[1]].device) for name in names}
    dest = Destination("staged", tensors, (f"{len(transforming)} of {len(names)} planned parameters belong to layers whose "
                                           f"post-load step packs or re-lays them out on {platform}" if transforming else "requested"))
    for name in names:
        module, attr = owner(model, name)
        module_name = name.rpartition(".")[0]
        if transforms_on(module, platform) and attr in CONSUMED:
            dest.modules[module_name] = module
            dest.rebuilt.setdefault(module_name, {})[attr] = tensors[name]
        else:
            dest.copied.append((module._parameters[attr].data, tensors[name]))
    return dest
