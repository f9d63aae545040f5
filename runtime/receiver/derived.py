"""Post-load state vLLM derives from synced parameters (e.g. MLA's W_UK/W_UV), recomputed on the receiver after each sync."""

from __future__ import annotations

import time

import torch

from ..errors import PlanMismatchError
from ..plan.format import Plan
from ..plan.schema import DerivedItem

MODES = ("refresh", "caller")


class DerivedRefresh:
    """The plan's receiver-side `derived` items this rank holds, resolved against its destination module.

    vLLM keeps some state computed from loaded weights outside them: an MLA attention layer's
    `process_weights_after_loading(act_dtype)` absorbs `kv_b_proj` into `W_UK_T`/`W_UV`. After a
    sync that state would describe the old weights, so with mode "refresh" each listed module's
    `process_weights_after_loading(act_dtype)` runs again once the sync's bytes have landed, as
    vLLM's own layerwise reload does for attention layers. Mode "caller" leaves it to the caller
    (a destination that is a dict of tensors has no modules to call).
    """

    def __init__(self, plan: Plan, held_names: set[str], destination, mode: str, act_dtype: torch.dtype):
        if mode not in MODES:
            raise ValueError(f"derived={mode!r}: choose one of {', '.join(MODES)}")
        items = [d for d in plan.derived if d.where == DerivedItem.RECEIVER and set(d.reads) <= held_names]
        self.mode, self.act_dtype, self.seconds = mode, act_dtype, 0.0
        self.modules: list[tuple[str, torch.nn.Module]] = []
        if mode == "caller" or not items:
            return
        if not isinstance(destination, torch.nn.Module):
            raise PlanMismatchError(
                f"the plan lists {len(items)} derived post-load items this rank must recompute after every sync "
                f"(e.g. {items[0].module}: {items[0].what}), but the destination is not a module; pass the vLLM model, "
                "or derived='caller' and recompute them yourself")
        for item in items:
            module_name, what = item.module, item.what
            try:
                module = destination.get_submodule(module_name)
            except AttributeError:
                module = None
            if not callable(getattr(module, "process_weights_after_loading", None)):
                raise PlanMismatchError(f"derived post-load item {module_name!r} ({what}): the destination has no such "
                                        "module with process_weights_after_loading; pass the model the plan was "
                                        "compiled for, or derived='caller'")
            self.modules.append((module_name, module))

    def __call__(self) -> float:
        """Recompute every held derived item from the parameters as they are now; returns the seconds spent."""
        began = time.perf_counter()
        with torch.no_grad():
            for _, module in self.modules:
                module.process_weights_after_loading(self.act_dtype)
        self.seconds = time.perf_counter() - began
        return self.seconds
