"""A live module's trainer tensors by plan name: wrapper components removed, FSDP2's sharded parameters, tied tensors once."""

from __future__ import annotations

import torch

from ..errors import LayoutError

# Module names wrappers insert into parameter names: activation checkpointing, torch.compile, FSDP1.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
_WRAPPERS = tuple(p.rstrip(".") for p in WRAPPER_PREFIXES)


def trainer_name(name: str) -> str:
    """A module's parameter name as the plan names it: the wrapper components removed."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _fsdp_sharded(module: torch.nn.Module) -> dict[tuple[int, str], torch.nn.Parameter]:
    """FSDP2's sharded parameter (a DTensor: the masters the optimizer updates) per (owning module, attribute).

    Outside FSDP2's sharded state (e.g. after a forward with reshard_after_forward=False) the module
    holds the all-gathered (and, with MixedPrecisionPolicy, cast) copies instead; those are never served.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return {}
    out = {}
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for p in group.fsdp_params:
                info = p._module_info
                owners = [(info.module, info.param_name)] + list(zip(info.shared_modules, info.shared_param_names))
                for owner, attr in owners:  # tied weights: every module holding the parameter
                    out[(id(owner), attr)] = p.sharded_param
    return out


def trainer_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer tensors of a live module, in state-dict order: {plan name: sharded parameter or buffer}.

    Names are the state-dict names without wrapper components (`_checkpoint_wrapped_module`,
    `_orig_mod`, `_fsdp_wrapped_module`). FSDP2-managed parameters are their sharded DTensors
    whatever the module currently holds; persistent buffers are included; a tensor reachable under
    several names (tied weights) is listed once, under its first name. LayoutError if two
    different tensors get the same name once the wrappers are removed.
    """
    sharded = _fsdp_sharded(module)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        tensors = [(attr, sharded.get((id(owner), attr), p)) for attr, p in owner._parameters.items() if p is not None]
        tensors += [(attr, b) for attr, b in owner._buffers.items()
                    if b is not None and attr not in owner._non_persistent_buffers_set]
        for attr, tensor in tensors:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            name = trainer_name(f"{prefix}.{attr}" if prefix else attr)
            if name in out:
                raise LayoutError(f"two tensors of the module are both named {name!r} once wrapper prefixes "
                                  f"({', '.join(WRAPPER_PREFIXES)}) are removed")
            out[name] = tensor
    return out
