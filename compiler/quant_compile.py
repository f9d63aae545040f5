"""The --quant modes of compile_plan, one object each: the vLLM quantization it builds with, its per-rank hooks, targets and kernel layout."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from weightplan.runtime.fp8.rounding import SCALE_ROUNDINGS, ScaleRounding
from weightplan.runtime.plan.header import QUANTS, QuantLayout
from weightplan.runtime.plan.schema import Quant
from .frontend.errors import ModelConfigError
from .ir import QuantTarget


@dataclasses.dataclass(frozen=True)
class QuantMode:
    """One --quant value; the defaults are those of a mode that quantizes nothing."""

    name: ClassVar[str]
    vllm_quantization: ClassVar[str | None] = None  # the quantization vLLM's config is built with

    @property
    def quantizes(self) -> bool:
        return self.vllm_quantization is not None

    @property
    def plan_token(self) -> str:
        """The mode's part of a default plan file name."""
        return self.name

    def hooks(self) -> QuantHooks | None:
        """What RankTracer calls around each rank's build and trace (None: load_weights writes every parameter)."""
        return None

    def targets(self, hooks: QuantHooks | None) -> tuple[QuantTarget, ...]:
        """What the post-load traces found to quantize."""
        return ()

    def kernel_layout(self, traced: dict[str, str] | None = None) -> QuantLayout | None:
        """How vLLM's kernels for this mode want weights and scales laid out (recorded in the plan header); `traced`:
        the kernels vLLM chose where the trace let it choose (CUDA: cuda_platform.traced_fp8_kernels)."""
        return None


@dataclasses.dataclass(frozen=True)
class NoQuant(QuantMode):
    """--quant none: vLLM's bf16 model."""

    name: ClassVar[str] = Quant.NONE.value


@dataclasses.dataclass(frozen=True)
class Fp8PerBlock(QuantMode):
    """--quant fp8_per_block: vLLM's online 128x128 block fp8, quantized by its post-load step (traced per rank)."""

    name: ClassVar[str] = Quant.FP8_PER_BLOCK.value
    vllm_quantization: ClassVar[str | None] = "fp8_per_block"  # vLLM's --quantization name, which happens to be ours
    scale_rounding: ScaleRounding = ScaleRounding.CUDA  # --scale-rounding: the engines' platform (runtime/fp8/rounding.py)

    def hooks(self) -> QuantHooks:
        return QuantHooks(self)

    def targets(self, hooks: QuantHooks | None) -> tuple[QuantTarget, ...]:
        """Refuses a model vLLM quantizes nothing of."""
        targets = hooks.targets() if hooks else ()
        if not targets:
            raise ModelConfigError(f"--quant {self.name}: vLLM quantizes no layer of this model online; compile with --quant none")
        return targets

    def kernel_layout(self, traced: dict[str, str] | None = None) -> QuantLayout:
        from .frontend.fp8_kernels import KERNEL_LAYOUT

        return dataclasses.replace(KERNEL_LAYOUT, scale_rounding=self.scale_rounding, **(traced or {}))

    @property
    def plan_token(self) -> str:
        return self.name if self.scale_rounding is ScaleRounding.CUDA else f"{self.name}-{self.scale_rounding.value}"


QUANT_MODES: dict[str, QuantMode] = {mode.name: mode for mode in (NoQuant(), Fp8PerBlock())}
assert tuple(QUANT_MODES) == QUANTS, "a compiler mode for each quantization a plan may name (runtime/plan/schema.py: Quant)"


def quant_mode(name: str, scale_rounding: str | None = None) -> QuantMode:
    """The mode of a --quant value (the plan header's QUANTS are the names allowed), with its --scale-rounding if it
    quantizes (None: the default, CUDA's)."""
    if name not in QUANTS:
        raise ModelConfigError(f"unknown --quant {name!r}; this version compiles: {', '.join(QUANTS)}")
    mode = QUANT_MODES[name]
    if scale_rounding is None:
        return mode
    if not isinstance(mode, Fp8PerBlock):
        raise ModelConfigError(f"--scale-rounding applies to --quant fp8_per_block, not to --quant {name}")
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ModelConfigError(f"unknown --scale-rounding {scale_rounding!r}; choose one of {', '.join(SCALE_ROUNDINGS)}")
    return dataclasses.replace(mode, scale_rounding=ScaleRounding(scale_rounding))


@dataclasses.dataclass
class QuantHooks:
    """What RankTracer calls around each rank's build and trace for fp8_per_block; collects what post-load found."""

    mode: Fp8PerBlock
    found: dict = dataclasses.field(default_factory=dict)
    derived: list = dataclasses.field(default_factory=list)  # DerivedItems, from the first rank
    padding: dict = dataclasses.field(default_factory=dict)  # bf16 name -> element ranges post-load sets to zero

    def build_context(self):
        """During model builds on the CPU platform: stub only vLLM's fp8 kernel choice (frontend/vllm_patches.py:
        triton_fp8_kernels; on CUDA vLLM chooses, and the plan records its choice)."""
        from .frontend.vllm_patches import triton_fp8_kernels

        return triton_fp8_kernels()

    def prepare(self, model) -> None:
        """Before tracing load_weights: let the quantized layers' loaders write their bf16 parameters."""
        from .frontend.fp8_trace import unwrap_online_loaders

        unwrap_online_loaders(model)

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
                raise ModelConfigError(f"{self.mode.name}: the post-load zero padding of {t.staging} differs between ranks")
        if not self.derived:
            self.derived.extend(post.derived)

    def targets(self) -> tuple[QuantTarget, ...]:
        """What the post-load traces found, as the QuantTargets place_quant places (in the order found)."""
        return tuple(QuantTarget(staging, weight, scale, tuple(map(tuple, self.padding.get(staging, ()))))
                     for staging, (weight, scale) in self.found.items())
