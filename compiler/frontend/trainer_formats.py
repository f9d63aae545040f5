"""Trainer tensors (names, shapes, dtypes) and their conversion to checkpoint tensors, traced.

`stacked` is transformers-5's in-memory layout: routed experts stacked as
`experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`.
`hf` is the checkpoint layout: one `experts.{e}.{gate,up,down}_proj.weight` per expert.
The table of trainer tensors comes from transformers' own model built on the meta device.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from ..ir import TensorSpec
from .errors import ModelConfigError
from .lazy_weight import dtype_name

TRAINER_FORMATS = ("hf", "stacked")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def stacked_state_dict(config_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' model for this config, on meta, with master weights in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(config_dir))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:
        raise ModelConfigError(f"transformers cannot build the trainer model from {config_dir}: {exc}") from None
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:  # tied weights appear under several names; the trainer holds one tensor
            continue
        seen.add(key)
        tensors[name] = tensor
    return tensors


def to_checkpoint(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors for one stacked trainer tensor; works on real, meta and Lazy tensors."""
    match = _STACKED.match(name)
    if match is None:
        yield name, tensor
        return
    prefix, kind = match["prefix"], match["kind"]
    for expert, stack in enumerate(tensor.unbind(0)):
        if kind == "gate_up_proj":
            gate, up = stack.chunk(2, dim=0)
            yield f"{prefix}.{expert}.gate_proj.weight", gate
            yield f"{prefix}.{expert}.up_proj.weight", up
        else:
            yield f"{prefix}.{expert}.down_proj.weight", stack


def trainer_specs(config_dir: Path, fmt: str, dtype: torch.dtype) -> list[TensorSpec]:
    """The trainer tensors of this format, in the trainer model's order."""
    if fmt not in TRAINER_FORMATS:
        raise ModelConfigError(f"unknown trainer format {fmt!r}; choose one of {', '.join(TRAINER_FORMATS)}")
    stacked = stacked_state_dict(config_dir, dtype)
    if fmt == "stacked":
        items = stacked.items()
    else:
        items = ((n, t) for name, tensor in stacked.items() for n, t in to_checkpoint(name, tensor))
    return [
        TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), "expert" if _STACKED.match(name) else "dense")
        for name, t in items
    ]


def checkpoint_tensors(fmt: str, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (name, tensor) vLLM's load_weights consumes for one trainer tensor."""
    if fmt == "stacked":
        yield from to_checkpoint(name, tensor)
    else:
        yield name, tensor
