"""The one place a plan's cast chain is applied to values (host executor, fp8 staging, sender staging)."""

from __future__ import annotations

import torch

# Elementwise steps a chain may hold besides dtypes, applied in the value's current dtype. vLLM's
# loaders compute them while loading (Mamba's `A = -exp(A_log.float())`); the sender applies them
# when it stages the source, so the wire carries final values. On CPU these are the same torch
# kernels vLLM's loader runs; a GPU sender's exp may differ from the CPU loader's in the last ulp.
ELEMENTWISE = {"exp": torch.exp, "neg": torch.neg}  # each takes `out=`
# `scale:<float>`: multiply by a Python float in the value's dtype, as vLLM folds a LoRA adapter's alpha/rank into
# lora_b (`lora_b *= scaling`, lora/lora_weights.py); the number is Python's round-tripping repr.
SCALE = "scale:"


def scale_step(factor: float) -> str:
    return f"{SCALE}{float(factor)!r}"


def elementwise(step: str):
    """The function of an elementwise chain step, or None if `step` is not one (a dtype, or unknown)."""
    function = ELEMENTWISE.get(step)
    if function is not None or not step.startswith(SCALE):
        return function
    try:
        factor = float(step[len(SCALE):])
    except ValueError:
        return None
    if factor != factor or factor in (float("inf"), float("-inf")):
        return None
    return lambda value, out=None: torch.mul(value, factor, out=out)


def is_elementwise(step: str) -> bool:
    return elementwise(step) is not None


CHAIN_RULE = (f"a list of known dtypes and elementwise steps ({', '.join(ELEMENTWISE)}, {SCALE}<float>) "
              "from a source dtype to a wire dtype")


def is_chain(chain, dtype_names) -> bool:
    """A chain (CHAIN_RULE) is a source dtype, then dtypes and elementwise steps, ending with the wire dtype."""
    return (isinstance(chain, (list, tuple)) and len(chain) > 0 and all(isinstance(step, str) for step in chain)
            and chain[0] in dtype_names and chain[-1] in dtype_names
            and all(step in dtype_names or is_elementwise(step) for step in chain))


def cast_along(value: torch.Tensor, chain: tuple[str, ...]) -> torch.Tensor:
    """Cast through every dtype of `chain` after the first (the source dtype) and apply its elementwise steps,
    in order, as vLLM's loaders did."""
    for step in chain[1:]:
        function = elementwise(step)
        value = function(value) if function is not None else value.to(getattr(torch, step))
    return value


def cast_into(out: torch.Tensor, value: torch.Tensor, chain: tuple[str, ...]) -> torch.Tensor:
    """Write `cast_along(value, chain)` into `out` (the wire dtype), the chain's last real step writing `out` itself:
    one pass over the bytes fewer than casting then copying (a dtype step to the dtype the value has is no step;
    `copy_` casts as `.to()` does)."""
    steps, dtype = [], value.dtype
    for step in chain[1:]:
        function = elementwise(step)
        if function is None:
            if getattr(torch, step) == dtype:
                continue
            dtype = getattr(torch, step)
        steps.append((function, dtype))
    for i, (function, dtype) in enumerate(steps):
        if i == len(steps) - 1 and function is not None and value.dtype == out.dtype:
            return function(value, out=out)
        if i == len(steps) - 1 and function is None:
            break  # the last cast: out.copy_ below
        value = function(value) if function is not None else value.to(dtype)
    return out.copy_(value)
