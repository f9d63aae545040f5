"""The one place a plan's cast chain is applied to values (host executor, fp8 staging, sender staging)."""

from __future__ import annotations

import torch

# Elementwise steps a chain may hold besides dtypes, applied in the value's current dtype. vLLM's
# loaders compute them while loading (Mamba's `A = -exp(A_log.float())`); the sender applies them
# when it stages the source, so the wire carries final values. On CPU these are the same torch
# kernels vLLM's loader runs; a GPU sender's exp may differ from the CPU loader's in the last ulp.
ELEMENTWISE = {"exp": torch.exp, "neg": torch.neg}


CHAIN_RULE = f"a list of known dtypes and elementwise steps ({', '.join(ELEMENTWISE)}) from a source dtype to a wire dtype"


def is_chain(chain, dtype_names) -> bool:
    """A chain (CHAIN_RULE) is a source dtype, then dtypes and elementwise steps, ending with the wire dtype."""
    return (isinstance(chain, (list, tuple)) and len(chain) > 0 and all(isinstance(step, str) for step in chain)
            and chain[0] in dtype_names and chain[-1] in dtype_names
            and all(step in dtype_names or step in ELEMENTWISE for step in chain))


def cast_along(value: torch.Tensor, chain: tuple[str, ...]) -> torch.Tensor:
    """Cast through every dtype of `chain` after the first (the source dtype) and apply its elementwise steps,
    in order, as vLLM's loaders did."""
    for step in chain[1:]:
        function = ELEMENTWISE.get(step)
        value = function(value) if function is not None else value.to(getattr(torch, step))
    return value
