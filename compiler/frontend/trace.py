"""Run vLLM's real load_weights on a meta model with LazyWeight sources and collect assignments."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field

import torch

from ..ir import Assignment, LayerReuse, TensorEntry
from ..layer_names import layer_of, rename
from .layer_classes import layer_classes, rename_assignments
from weightplan.runtime.checks import persistent_buffers
from weightplan.runtime.errors import WeightplanError
from .errors import TraceError
from .expert_templates import ExpertTemplates
from .lazy_weight import LazyWeight, WriteRecorder, dtype_name, tracing
from .trainer_formats import Conversion


@dataclass(frozen=True)
class TracedLoad:
    """One inference rank's traced loading: the assignments of the layers traced for real, the
    destination table, and the layers that load as a traced template layer does (index renamed)."""

    assignments: list[Assignment]
    dests: list[TensorEntry]
    layer_reuse: tuple[LayerReuse, ...] = ()
    reused_assignments: int = 0  # assignments the reused layers stand for
    # the names load_weights reported as loaded (if it reports any); not compared: a shared model is not fed the
    # experts other ranks hold (rank_models.py), so its report is shorter while its assignments are the real build's
    claimed: frozenset[str] = field(default=frozenset(), compare=False)
    unloaded: tuple[TensorEntry, ...] = ()  # parameters vLLM's load never writes (frontend/unloaded.py), not in dests
    expert_names_derived: int = field(default=0, compare=False)  # routed experts' checkpoint names derived, not fed (statistics)

    def expanded(self) -> list[Assignment]:
        """Every assignment, the reused layers' renamed from their template's (in member order)."""
        by_layer: dict[int | None, list[Assignment]] = defaultdict(list)
        for a in self.assignments:
            by_layer[layer_of(a.dest)].append(a)
        out = list(self.assignments)
        for reuse in self.layer_reuse:
            out.extend(rename_assignments(by_layer[reuse.template], reuse.template, reuse.member))
        return out


def trace_load(
    model: torch.nn.Module,
    sources: list[TensorEntry],
    conversion: Conversion,
    progress: Callable[[int, int], None] | None = None,
    *,
    reuse_layers: bool = True,
    skip: Callable[[str], bool] | None = None,
    derive_experts: bool = True,
) -> TracedLoad:
    """Feed LazyWeights for `sources` through `model.load_weights`; return what was traced.

    With `reuse_layers`, layers identical up to their index are traced once (see layer_classes):
    the others are listed as reusing their template layer, which the expand_layers pass turns
    into runs. Checkpoint names `skip` accepts are not fed (e.g. experts another rank holds:
    vllm_model.nonlocal_experts). With `derive_experts`, each MoE layer's routed experts between
    its first two and its last are derived, not fed (frontend/expert_templates.py).
    """
    params = dict(model.named_parameters())
    dests = [TensorEntry(name, tuple(p.shape), dtype_name(p.dtype)) for name, p in params.items()]
    classes = layer_classes(sources, dests) if reuse_layers else None
    fed = [spec for spec in sources if classes is None or classes.traced(spec.name)]
    claimed: set[str] = set()
    buffers = loaded_buffers(model, params)
    params = {**params, **buffers}
    experts = ExpertTemplates(model) if derive_experts else None
    traced = _trace(model, params, fed, conversion, progress, skip, claimed, experts)
    if classes is None or not classes.template_of:
        return _with_buffers(TracedLoad(traced, dests, claimed=frozenset(claimed),
                                        expert_names_derived=experts.names_derived if experts is not None else 0), buffers)

    by_layer: dict[int | None, list[Assignment]] = defaultdict(list)
    for a in traced:
        by_layer[layer_of(a.dest)].append(a)
    untrusted = set()
    for guard, template in classes.guards.items():
        if rename_assignments(by_layer[template], template, guard) != by_layer[guard]:
            untrusted.add(template)
    if untrusted:  # a layer class loads differently per index: trace all of its layers for real
        retrace = [s for s in sources if classes.template_of.get(layer_of(s.name)) in untrusted]
        traced += _trace(model, params, retrace, conversion, None, skip, claimed, experts)
    reuse = tuple(LayerReuse(template, index) for index, template in sorted(classes.template_of.items())
                  if template not in untrusted)
    return _with_buffers(TracedLoad(traced, dests, reuse, sum(len(by_layer[r.template]) for r in reuse), claimed=frozenset(claimed),
                                    expert_names_derived=experts.names_derived if experts is not None else 0), buffers)


def loaded_buffers(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's persistent buffers, which vLLM's AutoWeightsLoader loads from checkpoint tensors like parameters
    (xIELU's beta/eps, Gemma4's layer_scalar); buffers sharing storage with another destination are left out."""
    taken = {p.untyped_storage()._cdata for p in params.values()}
    out = {}
    for name, buffer in persistent_buffers(model):
        key = buffer.untyped_storage()._cdata
        if key not in taken:
            taken.add(key)
            out[name] = buffer
    return out


def _with_buffers(load: TracedLoad, buffers: dict[str, torch.Tensor]) -> TracedLoad:
    """`load` with the buffers it writes (in its traced or reused layers) as destinations, after the parameters."""
    written = {a.dest for a in load.assignments if a.dest in buffers}
    written |= {rename(n, r.template, r.member) for r in load.layer_reuse for n in list(written)}
    entries = [TensorEntry(n, tuple(b.shape), dtype_name(b.dtype)) for n, b in buffers.items() if n in written]
    return dataclasses.replace(load, dests=load.dests + entries) if entries else load


def _trace(model, params, sources: list[TensorEntry], conversion: Conversion, progress, skip=None,
           claimed: set[str] | None = None, experts: ExpertTemplates | None = None) -> list[Assignment]:
    """The assignments of loading `sources`; the names load_weights reports as loaded go into `claimed`.

    With `experts`, the routed experts between each layer's templates and guard are not fed but derived
    (frontend/expert_templates.py); if a guard fails, every name is traced for real.
    """
    tracer = WriteRecorder(params)
    lazy = {spec.name: LazyWeight.source(spec.name, spec.shape, getattr(torch, spec.dtype)) for spec in sources}
    index = {name: i for i, name in enumerate(lazy)}
    names: list[str] = []  # every checkpoint name loaded, fed or derived, in stream order
    derived: set[str] = set()

    def stream():
        for name, tensor in conversion(lazy.items()):
            if progress is not None:
                progress(max(index[s] for s in tensor.node.sources()) + 1, len(lazy))
            if skip is not None and skip(name):
                continue
            names.append(name)
            if experts is not None and experts.derived(name):
                derived.add(name)
                continue
            tracer.loading = name
            yield name, tensor

    with tracing(tracer), torch.no_grad():
        try:
            reported = model.load_weights(stream())
        except WeightplanError:
            raise
        except Exception as exc:  # vLLM's loader refused a checkpoint name or shape: one line, naming it
            raise TraceError(f"vLLM's {type(model).__name__}.load_weights failed while loading checkpoint tensor "
                             f"{tracer.loading!r}: {type(exc).__name__}: {exc}; check --trainer-format and that "
                             "transformers and vLLM agree on this architecture's checkpoint names") from None
    if claimed is not None and reported is not None:
        claimed.update(reported)
    if not derived:
        return tracer.assignments
    complete = experts.complete(tracer.assignments, names, derived)
    if complete is None:
        return _trace(model, params, sources, conversion, None, skip, claimed)
    experts.names_derived += len(derived)
    return complete
