"""Snapshot and restore the module state a post-load trace changes, so the same meta model can be loaded again."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from .errors import ModelConfigError

# nn.Module keeps parameters, buffers and submodules in these dicts, which register_parameter and
# setattr mutate in place; the dict objects themselves must survive (other code holds them).
_INNER = ("_parameters", "_buffers", "_modules")


def _owners(module: torch.nn.Module) -> list:
    """The module and its quant method: process_weights_after_loading sets state on both."""
    method = getattr(module, "quant_method", None)
    return [module] if method is None else [module, method]


def _save(obj) -> tuple:
    state = dict(obj.__dict__)
    return obj, state, {key: dict(state[key]) for key in _INNER if isinstance(state.get(key), dict)}


def _restore(obj, state: dict, inner: dict) -> None:
    obj.__dict__.clear()
    obj.__dict__.update(state)
    for key, items in inner.items():
        state[key].clear()
        state[key].update(items)


@contextlib.contextmanager
def restored(model: torch.nn.Module, modules: Iterable[torch.nn.Module]):
    """Run the body, then give `modules` (and their quant methods) back the exact attributes, parameters,
    buffers and submodules they had; refuse if the model's parameters are not the same objects after."""
    before = [(name, id(p)) for name, p in model.named_parameters()]
    saved = [_save(obj) for module in modules for obj in _owners(module)]
    try:
        yield
    finally:
        for obj, state, inner in saved:
            _restore(obj, state, inner)
    after = [(name, id(p)) for name, p in model.named_parameters()]
    if after != before:
        changed = sorted({n for n, _ in before} ^ {n for n, _ in after}) or [n for (n, a), (_, b) in zip(before, after) if a != b]
        raise ModelConfigError(f"restoring the model after tracing its post-load step left {len(changed)} parameters "
                               f"changed, e.g. {', '.join(changed[:5])}: vLLM's post-load step changed state frontend/module_state.py "
                               f"does not snapshot; it must learn to restore it before models can be shared")
