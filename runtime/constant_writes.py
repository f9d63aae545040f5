"""Writing a plan's constant runs (vLLM's fill_/zero_ of padding) into an inference rank's destination tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .plan.format import Plan


def write_constants(plan: Plan, rank: int, flat: Callable[[int], torch.Tensor], only: set[str] | None = None) -> int:
    """Fill every constant run of the entries inference `rank` holds (those named in `only`, if given); returns the bytes.

    `flat(dest)` gives destination entry `dest` as a flat tensor. Constants never go on the wire:
    the rank writes them itself, and no run of the plan touches their bytes (compiler/passes/verify.py).
    """
    written = 0
    with torch.no_grad():
        for c in plan.constants:
            entry = plan.dests[c.dest]
            if rank not in entry.ranks or (only is not None and entry.name not in only):
                continue
            target = flat(c.dest)[c.dst_off : c.dst_off + c.length]
            target.fill_(c.value)
            written += c.length * target.element_size()
    return written
