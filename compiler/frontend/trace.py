"""Run vLLM's real load_weights on a meta model with LazyWeight sources and collect assignments."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ir import Assignment, TensorSpec
from .lazy_weight import LazyWeight, Tracer, dtype_name, tracing
from .trainer_formats import checkpoint_tensors


def trace_load(
    model: torch.nn.Module,
    sources: list[TensorSpec],
    fmt: str,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[Assignment], list[TensorSpec]]:
    """Feed LazyWeights for `sources` through `model.load_weights`; return assignments and destinations."""
    params = dict(model.named_parameters())
    tracer = Tracer(params)
    lazy = {
        spec.name: LazyWeight.source(spec.name, spec.shape, getattr(torch, spec.dtype)) for spec in sources
    }

    def stream():
        for index, (trainer_name, trainer_tensor) in enumerate(lazy.items()):
            if progress is not None:
                progress(index + 1, len(lazy))
            for name, tensor in checkpoint_tensors(fmt, trainer_name, trainer_tensor):
                tracer.loading = name
                yield name, tensor

    with tracing(tracer), torch.no_grad():
        model.load_weights(stream())
    dests = [TensorSpec(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in params.items()]
    return tracer.assignments, dests
