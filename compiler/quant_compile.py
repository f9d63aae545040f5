"""The --quant hooks of compile_plan: build context, post-load trace per rank, and block placement at the end."""

from __future__ import annotations

import contextlib
import dataclasses

from .frontend.errors import ModelConfigError
import numpy as np

from .ir import Constants, Program
from .passes.place_quant import place_quant
from .passes.verify import Coverage, verify
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
            self.derived.extend([d.module, d.what, list(d.reads), d.where] for d in post.derived)


def hooks(quant: str) -> QuantHooks | None:
    return None if quant == "none" else QuantHooks(quant)


def finish(quant: str, program: Program, found: dict, derived: list, padding: dict | None = None) -> tuple[Program, Coverage]:
    """Check coverage and, with fp8, place every block's quantization; returns the program to write, listing `derived`.

    With fp8, a quantized bf16 tensor's bytes are written by runs, by zero constants its loader
    wrote, or by the zero padding its post-load step writes (`padding`: name -> element ranges);
    every byte exactly once.
    """
    if quant == "none":
        return dataclasses.replace(program, meta=dict(program.meta, derived=derived)), verify(program)
    zeros = [c for i, c in enumerate(program.constants.values) if program.dests[program.constants.dest[i]].name in found and c != 0]
    if zeros:
        raise ModelConfigError(f"fp8_per_block: a loader writes the constant {zeros[0]} into a tensor vLLM quantizes; "
                               "only zero padding is supported")
    verify(_with_padding(program, padding or {}))  # refuses overlaps, and names the first unwritten byte range
    if not found:
        raise ModelConfigError(f"--quant {quant}: vLLM quantizes no layer of this model online; compile with --quant none")
    from .frontend.fp8_kernels import KERNEL_LAYOUT

    program = dataclasses.replace(program, meta=dict(program.meta, quant_tensors=found))
    placed = place_quant(program)
    placed.meta["quant_layout"] = KERNEL_LAYOUT
    placed.meta["derived"] = derived
    q = placed.meta["quant_placement"]
    verify_quant([shape for _, shape, _, _, _ in q.staging], [len(ranks) for _, _, ranks, _, _ in q.staging], q.stage, q.spans)
    after = verify(placed, require_full_coverage=False)
    quant_bytes = sum((placed.dests[w].numel + 4 * placed.dests[s].numel) * len(ranks) for _, _, ranks, w, s in q.staging)
    return placed, Coverage(after.dst_bytes, after.written_once_bytes + quant_bytes, (), constant_bytes=after.constant_bytes)


def _with_padding(program: Program, padding: dict) -> Program:
    """`program` with the post-load zero padding of its quantized tensors added as constants (for the coverage check)."""
    rows = [(d, start, end - start) for d, spec in enumerate(program.dests) for start, end in padding.get(spec.name, ())]
    if not rows:
        return program
    dest, off, length = (np.array(column, dtype=np.int64) for column in zip(*rows))
    c = program.constants
    extra = Constants(np.concatenate([c.dest, dest]), np.concatenate([c.dst_off, off]), np.concatenate([c.length, length]),
                      c.values + (0.0,) * len(rows))
    return dataclasses.replace(program, constants=extra)
