"""The --quant hooks of compile_plan: build context, post-load trace per rank, and block placement at the end."""

from __future__ import annotations

import contextlib
import dataclasses

from .frontend.errors import ModelConfigError
from .ir import Program
from .passes.place_quant import place_quant
from .passes.verify import Coverage, PlanInvariantError, verify
from .passes.verify_quant import verify_quant

QUANTS = ("none", "fp8_per_block")


def vllm_quantization(quant: str) -> str | None:
    return None if quant == "none" else quant


def build_context(quant: str):
    """During model builds: stub only vLLM's fp8 kernel choice (frontend/vllm_patches.py: triton_fp8_kernels)."""
    if quant == "none":
        return contextlib.nullcontext()
    from .frontend.vllm_patches import triton_fp8_kernels

    return triton_fp8_kernels()


def prepare_trace(quant: str, model) -> None:
    """Before tracing load_weights: let the quantized layers' loaders write their bf16 parameters."""
    if quant != "none":
        from .frontend.fp8_trace import unwrap_online_loaders

        unwrap_online_loaders(model)


@dataclasses.dataclass
class QuantHooks:
    """What RankTracer calls around each rank's build and trace for `quant`; collects what post-load found."""

    quant: str
    found: dict = dataclasses.field(default_factory=dict)
    derived: list = dataclasses.field(default_factory=list)

    def build_context(self):
        return build_context(self.quant)

    def prepare(self, model) -> None:
        prepare_trace(self.quant, model)

    def post_load(self, model, classes, *, keep_model: bool):
        """Trace process_weights_after_loading on one rank's model (identical layers once, per `classes`);
        `keep_model` restores the model after, for a model shared by several ranks."""
        from .frontend.post_load import trace_rank_post_load

        return trace_rank_post_load(model, classes, keep_model=keep_model)

    def collect(self, post) -> None:
        """Add one rank's post-load result (ranks in order): quantized tensors by bf16 name; derived state once."""
        for t in post.tensors:
            self.found[t.staging] = (t.weight, t.scale)
        if not self.derived:
            self.derived.extend([d.module, d.what, list(d.reads), d.where] for d in post.derived)


def hooks(quant: str) -> QuantHooks | None:
    return None if quant == "none" else QuantHooks(quant)


def finish(quant: str, program: Program, found: dict, derived: list) -> tuple[Program, Coverage]:
    """Check coverage and, with fp8, place every block's quantization; returns the program to write, listing `derived`."""
    if quant == "none":
        return dataclasses.replace(program, meta=dict(program.meta, derived=derived)), verify(program)
    coverage = verify(program, require_full_coverage=False)
    stray = [name for name in coverage.uncovered if name not in found]
    if stray:
        raise PlanInvariantError(f"{len(stray)} destination tensors are not fully written by the plan, e.g. {', '.join(stray[:5])}")
    if not found:
        raise ModelConfigError(f"--quant {quant}: vLLM quantizes no layer of this model online; compile with --quant none")
    from .frontend.fp8_kernels import KERNEL_LAYOUT

    program = dataclasses.replace(program, meta=dict(program.meta, quant_tensors=found))
    placed = place_quant(program)
    placed.meta["quant_layout"] = KERNEL_LAYOUT
    placed.meta["derived"] = derived + [
        [name, "zero padding of rows/cols vLLM adds to reach 128 multiples (MoE); bytes no run writes", [name], "plan"]
        for name in coverage.uncovered
    ]
    q = placed.meta["quant_placement"]
    verify_quant([shape for _, shape, _, _, _ in q.staging], [len(ranks) for _, _, ranks, _, _ in q.staging], q.stage, q.spans)
    after = verify(placed, require_full_coverage=False)
    quant_bytes = sum((placed.dests[w].numel + 4 * placed.dests[s].numel) * len(ranks) for _, _, ranks, w, s in q.staging)
    return placed, Coverage(after.dst_bytes, after.written_once_bytes + quant_bytes, ())
