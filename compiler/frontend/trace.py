"""Run vLLM's real load_weights on a meta model with LazyWeight sources and collect assignments."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from ..ir import Assignment, TensorEntry
from .layer_classes import layer_classes, layer_of, rename_assignments
from ...runtime.errors import WeightplanError
from .errors import TraceError
from .lazy_weight import LazyWeight, Tracer, dtype_name, tracing
from .trainer_formats import Conversion


def trace_load(
    model: torch.nn.Module,
    sources: list[TensorEntry],
    conversion: Conversion,
    progress: Callable[[int, int], None] | None = None,
    *,
    reuse_layers: bool = True,
    skip: Callable[[str], bool] | None = None,
) -> tuple[list[Assignment], list[TensorEntry]]:
    """Feed LazyWeights for `sources` through `model.load_weights`; return assignments and destinations.

    With `reuse_layers`, layers identical up to their index are traced once (see layer_classes).
    Checkpoint names `skip` accepts are not fed (e.g. experts another rank holds: vllm_model.nonlocal_experts).
    """
    params = dict(model.named_parameters())
    dests = [TensorEntry(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in params.items()]
    classes = layer_classes(sources, dests) if reuse_layers else None
    fed = [spec for spec in sources if classes is None or classes.traced(spec.name)]
    traced = _trace(model, params, fed, conversion, progress, skip)
    if classes is None or not classes.template_of:
        return traced, dests

    by_layer: dict[int | None, list[Assignment]] = defaultdict(list)
    for a in traced:
        by_layer[layer_of(a.dest)].append(a)
    untrusted = set()
    for guard, template in classes.guards.items():
        if rename_assignments(by_layer[template], template, guard) != by_layer[guard]:
            untrusted.add(template)
    if untrusted:  # a layer class loads differently per index: trace all of its layers for real
        retrace = [s for s in sources if classes.template_of.get(layer_of(s.name)) in untrusted]
        traced += _trace(model, params, retrace, conversion, None, skip)
    out = list(traced)
    for index, template in sorted(classes.template_of.items()):
        if template not in untrusted:
            out.extend(rename_assignments(by_layer[template], template, index))
    return out, dests


def _trace(model, params, sources: list[TensorEntry], conversion: Conversion, progress, skip=None) -> list[Assignment]:
    tracer = Tracer(params)
    lazy = {spec.name: LazyWeight.source(spec.name, spec.shape, getattr(torch, spec.dtype)) for spec in sources}
    index = {name: i for i, name in enumerate(lazy)}

    def stream():
        for name, tensor in conversion(lazy.items()):
            if progress is not None:
                progress(max(index[s] for s in tensor.node.sources()) + 1, len(lazy))
            if skip is not None and skip(name):
                continue
            tracer.loading = name
            yield name, tensor

    with tracing(tracer), torch.no_grad():
        try:
            model.load_weights(stream())
        except WeightplanError:
            raise
        except Exception as exc:  # vLLM's loader refused a checkpoint name or shape: one line, naming it
            raise TraceError(f"vLLM's {type(model).__name__}.load_weights failed while loading checkpoint tensor "
                             f"{tracer.loading!r}: {type(exc).__name__}: {exc}; check --trainer-format and that "
                             "transformers and vLLM agree on this architecture's checkpoint names") from None
    return tracer.assignments
