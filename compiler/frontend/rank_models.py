"""Trace every inference rank with one vLLM model per (pipeline, TP) rank, re-pointed per DP rank (guarded).

Under DP (attention), the ranks that share a pipeline and TP rank build identical modules; only the MoE
layers' expert placement depends on the DP rank (which experts are local with EP, which TP slice
of every expert without it). So the model of DP rank 0 is built once per TP rank, and each other
rank re-points its MoE layers with vLLM's own `update_expert_map` (`place_experts`) and is traced
on it, fed only the checkpoint names of its own experts (`nonlocal_experts`: vLLM's loader writes
nothing for the others; under EPLB every name is fed, the expert map indexing physical slots).

With quantization hooks, each rank's post-load step (process_weights_after_loading) is traced after
its load. On a shared model it is traced once per TP rank, at DP rank 0, and the model is restored
afterwards (frontend/module_state.py) so the next rank loads into the same bf16 parameters; the
other DP ranks reuse that result (the post-load step reads no expert placement, only shapes).

Guard: before a re-pointed trace is used, the last rank is traced on the re-pointed model and also
built and traced for real (all names fed, its own post-load step); destinations, assignments and
the post-load result sharing would give it must be identical, or every rank is built for real (as
is any rank whose re-pointing would change a parameter shape).

Without DP sharing and quantization hooks, with at least 4 TP ranks, only the first, second and
last TP rank of each pipeline stage are built and traced; the others are derived from the first two
(frontend/extrapolate.py: every integer moves by one fixed step per TP rank). Guard: the last
rank's derivation must equal its real trace, or every TP rank of that stage is built for real.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

from weightplan.runtime.plan.header import RankCoords
from weightplan.runtime.plan.schema import DerivedItem
from ..gc_pause import collect_dropped
from ..timing import phase
from .fp8_trace import derived_state
from .layer_classes import layer_classes
from .extrapolate import Line, NotAffine
from .trace import TracedLoad, trace_load
from .trainer_formats import Conversion
from .unloaded import split_unloaded
from .vllm_model import build_model, check_linear_slots, eplb_layers, nonlocal_experts, place_experts
from .vllm_patches import clear_layer_registry, forget_pp_missing_layers, parallel_rank


TP_TEMPLATE_MIN = 4  # with fewer TP ranks, the first, second and last are all of them


class RankTracer:
    """`trace(rank)` -> (assignments, dests) of one inference rank; ranks are asked for in order."""

    def __init__(self, vllm_config, base_config, layout, sources, conversion: Conversion, timings: dict, *, share: bool = True,
                 quant_hooks=None, derive_tp: bool = True, derive_experts: bool = True):
        self.vllm_config, self.base_config, self.layout = vllm_config, base_config, layout
        self.sources, self.conversion, self.timings = sources, conversion, timings
        self.hooks = quant_hooks
        self.share = share and layout.dp > 1
        # keyed by (pipeline rank, TP rank): the ranks sharing a model differ only in their DP rank
        self.models: dict[tuple[int, int], object] = {}  # -> model built for DP rank 0
        self.placed_at: dict[tuple[int, int], int] = {}  # -> DP rank its shared model is placed for
        self.post: dict[tuple[int, int], object] = {}  # -> post-load result of its shared model (traced at DP rank 0)
        self.guarded: dict[int, tuple] = {}  # the guard rank's real trace, until asked for
        self.stats = {"models_built": 0, "ranks_repointed": 0, "guard": "not run" if self.share else "off", "names_skipped": 0}
        self.derived: list[DerivedItem] | None = None  # without quant hooks: derived post-load state, read from the first model traced
        if quant_hooks is not None:
            self.stats["post_load_traces"] = 0
        # TP templates: keyed by (DP rank, pipeline rank), the traced loads of TP ranks 0 and 1, and the guard's verdict
        # under EPLB a rank's slots hold logical experts that do not move by one fixed step per rank: every rank traced
        self.eplb = getattr(layout, "eplb", None) is not None
        self.eplb_layers: tuple[tuple[str, ...], ...] | None = None  # per MoE layer, its expert tensors (EplbHeader)
        self.logical_experts: int | None = None
        self.derive_tp = (derive_tp and not self.share and quant_hooks is None and layout.tp >= TP_TEMPLATE_MIN
                          and not self.eplb)
        self.tp_traced: dict[tuple[int, int], dict[int, TracedLoad]] = {}
        self.tp_lines: dict[tuple[int, int], Line] = {}  # -> the line through TP ranks 0 and 1, until the stage is derived
        self.tp_guard: dict[tuple[int, int], bool] = {}
        self.stats["tp_ranks_derived"] = 0
        self.derive_experts = derive_experts
        self.stats["expert_names_derived"] = 0  # over every trace run (frontend/expert_templates.py)
        self.stats["tp_guard"] = "not run" if self.derive_tp else "off"

    def trace(self, rank: int, progress: Callable[[int, int], None] | None = None) -> TracedLoad:
        at = self.layout.rank_coords(rank)
        if self.share and at.dp > 0 and self.stats["guard"] == "not run":
            self._guard()
        if rank in self.guarded:  # the guard rank (which may be this first re-pointed one): its real trace
            return self._collect(self.guarded.pop(rank))
        if self.share:
            model = self._placed(at)
            if model is not None:
                self.stats["ranks_repointed"] += at.dp > 0
                return self._collect(self._trace(model, at, progress, shared=True))
        if self.derive_tp:
            return self._tp_rank(at, progress)
        return self._collect(self._real(at, progress))

    def _real(self, at: RankCoords, progress) -> tuple[TracedLoad, object]:
        """Build this rank's own model, trace it and drop it."""
        model = self._build(at)
        try:
            return self._trace(model, at, progress, shared=False)
        finally:
            del model
            self._drop_models()

    def _drop_models(self) -> None:
        """Free the models no longer held: vLLM's layer registries keep the last one alive, and its modules form cycles."""
        with phase(self.timings, "build"):
            clear_layer_registry(self.vllm_config)
            forget_pp_missing_layers()
            collect_dropped()

    def _tp_rank(self, at: RankCoords, progress) -> TracedLoad:
        """A rank of a stage whose TP ranks 0 and 1 are traced for real, the last too (the guard), the others derived."""
        key, last = (at.dp, at.pp), self.layout.tp - 1
        traced = self.tp_traced.setdefault(key, {})
        if at.tp in traced:  # the guard's real trace, asked for now
            return traced.pop(at.tp)
        if at.tp < 2:
            traced[at.tp] = self._real(at, progress)[0]
            return traced[at.tp]
        if key not in self.tp_guard:
            traced[last] = self._real(dataclasses.replace(at, tp=last), None)[0]
            with phase(self.timings, "derive"):
                try:
                    self.tp_lines[key] = Line(traced.pop(0), traced.pop(1))
                    self.tp_guard[key] = self.tp_lines[key](last) == traced[last]
                except NotAffine:
                    self.tp_guard[key] = False
            self._tp_guard_stats()
        if not self.tp_guard[key]:
            self.tp_lines.pop(key, None)
            return self._real(at, progress)[0]
        self.stats["tp_ranks_derived"] += 1
        with phase(self.timings, "derive"):
            derived = self.tp_lines[key](at.tp)
        if at.tp == last - 1:  # the stage's last derivation
            del self.tp_lines[key]
        return derived

    def _tp_guard_stats(self) -> None:
        passed = [f"pp {pp}" + (f" dp {dp}" if dp else "") for (dp, pp), ok in sorted(self.tp_guard.items()) if ok]
        failed = [f"pp {pp}" + (f" dp {dp}" if dp else "") for (dp, pp), ok in sorted(self.tp_guard.items()) if not ok]
        self.stats["tp_guard"] = "; ".join(part for part in (
            f"passed (TP rank {self.layout.tp - 1} of {', '.join(passed)})" if passed else "",
            f"failed ({', '.join(failed)}): those stages' TP ranks built for real" if failed else "") if part)

    def _collect(self, traced: tuple) -> TracedLoad:
        load, post = traced
        if self.hooks:
            self.hooks.collect(post)
        return load

    def _guard(self) -> None:
        """Trace the last rank on a re-pointed model and on a real build; share models only if identical."""
        rank = self.layout.ranks - 1
        at = self.layout.rank_coords(rank)
        model = self._placed(at)
        shared = self._trace(model, at, None, shared=True) if model is not None else None
        context = self.vllm_config.compilation_config.static_forward_context
        kept = dict(context)  # the shared model's layers; the real build registers its own
        fresh = self._build(at)
        real = self._trace(fresh, at, None, shared=False)
        del fresh
        context.clear()
        context.update(kept)
        collect_dropped()
        self.guarded[rank] = real
        if model is None:
            return  # _placed gave up already and said why
        if shared == real:
            self.stats["guard"] = f"passed (rank {rank})"
        else:
            self.stats["guard"] = f"failed (rank {rank}): every rank built for real"
            self._stop_sharing()

    def _placed(self, at: RankCoords):
        """The shared model of this (pipeline, TP) rank with its MoE layers placed for DP rank `at.dp`, or None."""
        key, first = (at.pp, at.tp), dataclasses.replace(at, dp=0)
        model = self.models.get(key)
        if model is None:
            model = self.models[key] = self._build(first)
            # Placing a model for the rank it was built for must change nothing.
            if self._place(model, first) != 0:
                return self._give_up("re-pointing a model to its own DP rank changed it")
        if self.placed_at.get(key, 0) != at.dp:
            if self._place(model, at) is None:
                return self._give_up(f"re-pointing to DP rank {at.dp} changed a parameter shape")
        self.placed_at[key] = at.dp
        return model

    def _place(self, model, at: RankCoords) -> int | None:
        with phase(self.timings, "build"):
            return place_experts(model, self.vllm_config, at.tp, at.dp, at.pp)

    def _give_up(self, why: str) -> None:
        self.stats["guard"] = f"{why}: every rank built for real"
        self._stop_sharing()
        return None

    def _stop_sharing(self) -> None:
        self.share = False
        self.models.clear()
        self.placed_at.clear()
        self.post.clear()
        self._drop_models()

    def _build(self, at: RankCoords):
        with phase(self.timings, "build"):
            with self.hooks.build_context() if self.hooks else contextlib.nullcontext():
                model = build_model(self.vllm_config, tp_rank=at.tp, dp_rank=at.dp, pp_rank=at.pp, base_config=self.base_config)
                if self.hooks:
                    self.hooks.prepare(model)
        self.stats["models_built"] += 1
        return model

    def _trace(self, model, at: RankCoords, progress, *, shared: bool) -> tuple[TracedLoad, object]:
        """(the traced loading, the post-load result or None) of this rank on `model`."""
        with phase(self.timings, "trace"), parallel_rank(self.vllm_config, at.tp, at.dp, at.pp):
            if self.eplb:  # the slots each rank holds are the ones the plan header says
                check_linear_slots(model, self.layout.rank_of(at), self.layout.tp * self.layout.dp)
                if self.eplb_layers is None:
                    self.logical_experts, self.eplb_layers = eplb_layers(model)
            # on a shared model, experts other ranks hold are not fed (checked by the guard's real build; not under EPLB)
            absent = nonlocal_experts(model) if shared else None
            traced = trace_load(model, self.sources, self.conversion, progress,
                                skip=None if absent is None else functools.partial(self._skip, absent),
                                derive_experts=self.derive_experts)
            self.stats["expert_names_derived"] += traced.expert_names_derived
            if self.hooks is None:  # with --quant, the post-load step writes what load_weights does not
                traced = split_unloaded(model, self.vllm_config, traced, self.layout.rank_of(at))
            dests = traced.dests
            post = None
            if self.hooks is None and self.derived is None:
                self.derived = list(derived_state(model))
            if self.hooks:
                if not shared:
                    post = self._post_load(model, dests, keep_model=False)
                else:
                    if (at.pp, at.tp) not in self.post:
                        self.post[at.pp, at.tp] = self._post_load(model, dests, keep_model=True)
                    post = self.post[at.pp, at.tp]
            return traced, post

    def _skip(self, absent, name: str) -> bool:
        hit = absent(name)
        self.stats["names_skipped"] += hit
        return hit

    def _post_load(self, model, dests: list, *, keep_model: bool):
        self.stats["post_load_traces"] += 1
        with self.hooks.build_context():
            return self.hooks.post_load(model, layer_classes(self.sources, dests), keep_model=keep_model)
