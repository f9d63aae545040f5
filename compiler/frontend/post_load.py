"""Trace one rank's post-load step: template and guard layers through vLLM, the layers between renamed (guarded).

The post-load step runs per module, and vLLM's per-block quantization on `meta` costs milliseconds
per matrix (each local expert is quantized on its own), so processing all 78 GLM-5.2 layers takes
seconds. Layers that `layer_classes` groups (identical up to their index in trainer tensors and vLLM
parameters) are processed like the load trace treats them: the template and the guard layer
through vLLM; the guard's result must equal the template's renamed, or the whole class is processed
for real; the layers between reuse the template's result renamed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch

from weightplan.runtime.plan.schema import DerivedItem
from .fp8_trace import QuantTensor, derived_state, quantized_modules, trace_post_load
from ..layer_names import layer_of, rename
from .layer_classes import LayerClasses
from .module_state import restored


@dataclass(frozen=True)
class PostLoad:
    """What tracing one rank's post-load step found: the tensors vLLM quantizes and the state it derives."""

    tensors: tuple[QuantTensor, ...]
    derived: tuple[DerivedItem, ...]


def trace_rank_post_load(model: torch.nn.Module, classes: LayerClasses | None = None, *, keep_model: bool = False) -> PostLoad:
    """The post-load result of one rank's model; `classes` (from layer_classes) lets identical layers reuse one trace.

    With `keep_model`, the model is restored afterwards to the state load_weights traced (bf16
    parameters, unprocessed layers), so it can serve another rank.
    """
    reused = dict(classes.template_of) if classes else {}
    guards = dict(classes.guards) if classes else {}
    modules = [module for _, module in quantized_modules(model)]
    with restored(model, modules) if keep_model else contextlib.nullcontext():
        tensors = trace_post_load(model, lambda name: layer_of(name) not in reused)
        derived = derived_state(model, lambda name: layer_of(name) not in reused)
        untrusted = {template for guard, template in guards.items()
                     if _renamed(_layer(tensors, template), template, guard) != _layer(tensors, guard)
                     or _renamed(_layer(derived, template), template, guard) != _layer(derived, guard)}
        redo = {index for index, template in reused.items() if template in untrusted}
        if redo:  # a class processes differently per index: process all of its layers for real
            tensors += trace_post_load(model, lambda name: layer_of(name) in redo)
            reused = {index: template for index, template in reused.items() if index not in redo}
            derived = derived_state(model, lambda name: layer_of(name) not in reused)
    of_template = {template: (_layer(tensors, template), _layer(derived, template)) for template in set(reused.values())}
    for index, template in reused.items():
        tensors += _renamed(of_template[template][0], template, index)
        derived += _renamed(of_template[template][1], template, index)
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    # stable sorts: model order, and within a module the order vLLM's processing gave
    return PostLoad(tuple(sorted(tensors, key=lambda t: order[_module(t)])), tuple(sorted(derived, key=lambda d: order[d.module])))


def _module(item) -> str:
    return item.staging.rsplit(".", 1)[0] if isinstance(item, QuantTensor) else item.module


def _layer(items: list, index: int) -> list:
    return [item for item in items if layer_of(_module(item)) == index]


def _renamed(items: list, old: int, new: int) -> list:
    out = []
    for item in items:
        if isinstance(item, QuantTensor):
            out.append(replace(item, staging=rename(item.staging, old, new), weight=rename(item.weight, old, new),
                               scale=rename(item.scale, old, new)))
        else:
            out.append(replace(item, module=rename(item.module, old, new), reads=tuple(rename(r, old, new) for r in item.reads)))
    return out
