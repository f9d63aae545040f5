"""The --quant hooks of compile_plan: the build context and the post-load trace per rank, collected as QuantTargets."""

from __future__ import annotations

import contextlib
import dataclasses

from ..runtime.plan.header import QuantLayout
from .frontend.errors import ModelConfigError
from .ir import QuantTarget


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
    derived: list = dataclasses.field(default_factory=list)  # DerivedItems, from the first rank
    padding: dict = dataclasses.field(default_factory=dict)  # bf16 name -> element ranges post-load sets to zero

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
            if self.padding.setdefault(t.staging, t.padding) != t.padding:
                raise ModelConfigError(f"fp8_per_block: the post-load zero padding of {t.staging} differs between ranks")
        if not self.derived:
            self.derived.extend(post.derived)


    def targets(self) -> tuple[QuantTarget, ...]:
        """What the post-load traces found, as the QuantTargets place_quant places (in the order found)."""
        return tuple(QuantTarget(staging, weight, scale, tuple(map(tuple, self.padding.get(staging, ()))))
                     for staging, (weight, scale) in self.found.items())


def hooks(quant: str) -> QuantHooks | None:
    return None if quant == "none" else QuantHooks(quant)


def quant_targets(quant: str, found: QuantHooks | None) -> tuple[QuantTarget, ...]:
    """What the post-load traces found to quantize; refuses `--quant` for a model vLLM quantizes nothing of."""
    targets = found.targets() if found else ()
    if quant != "none" and not targets:
        raise ModelConfigError(f"--quant {quant}: vLLM quantizes no layer of this model online; compile with --quant none")
    return targets


def kernel_layout(quant: str) -> QuantLayout | None:
    """How vLLM's kernels for `quant` want weights and scales laid out (recorded in the plan header)."""
    if quant == "none":
        return None
    from .frontend.fp8_kernels import KERNEL_LAYOUT

    return KERNEL_LAYOUT
