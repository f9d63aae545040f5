"""`make sweep`: compile and verify a tiny config of every architecture vLLM and transformers share, per trainer format.

One line per architecture and format (compiled, verified, seconds, and why not), then a last
line of JSON: {"attempted", "compiled", "verified", "failures", "vllm_cpu_cannot_build", "vllm_cannot_load",
"multimodal_not_swept"}. The zoo is every transformers causal LM vLLM serves as a text model, with its own class or
through its Transformers modeling backend; multimodal architectures are listed, not swept (their text models are).
A format that does not compile is loaded once more by vLLM itself, from real tensors (its own
load_weights and DefaultModelLoader's check); if vLLM refuses them too, the line says so and is
counted under vllm_cannot_load, not attempted.
Each architecture runs in its own process (a crash or hang costs that line only).
Usage: python benchmarks/sweep.py [--only TYPE,TYPE] [--timeout S] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from zoo_configs import multimodal_zoo, write_config, zoo  # noqa: E402


def run_one(model_type: str, architecture: str, workdir: Path) -> None:
    """Child: build the tiny config, check vLLM can build it, then compile and verify each format; JSON lines out."""
    import torch

    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.trainer_formats import TrainerFormat, load_trainer_model
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.compiler.verify_plan import verify_plan

    def emit(fmt, **row):
        print("SWEEP " + json.dumps({"model_type": model_type, "architecture": architecture, "format": fmt, **row}), flush=True)

    try:
        config_dir = write_config(workdir / model_type, model_type, architecture)
        trainer = load_trainer_model(config_dir, torch.bfloat16)
    except Exception as exc:
        return emit("-", compiled=False, verified=False, seconds=0.0, reason=f"no tiny config: {_line(exc)}")
    try:  # on the CPU device, with real storage: what vLLM's CPU platform itself would build
        build_model(make_vllm_config(config_dir), "cpu")
    except Exception as exc:
        return emit("-", compiled=False, verified=False, seconds=0.0, unbuildable=True,
                    reason=f"vLLM's CPU platform cannot build it: {_line(exc)}")
    same = {s.name for s in trainer.specs(TrainerFormat.HF)} == {s.name for s in trainer.specs(TrainerFormat.TRANSFORMERS)}
    for fmt in (TrainerFormat.HF,) if same else (TrainerFormat.HF, TrainerFormat.TRANSFORMERS):
        label = "hf=transformers" if same else fmt
        start = time.perf_counter()
        plan = workdir / f"{model_type}-{fmt}.plan"
        try:
            compile_plan(CompileOptions(str(config_dir), fmt, "bf16", "none", plan))
        except Exception as exc:
            refused = vllm_refuses(config_dir, trainer, fmt)
            emit(label, compiled=False, verified=False, seconds=round(time.perf_counter() - start, 1), reason=_line(exc)
                 + (f"; vLLM's own load of these checkpoint tensors fails too: {refused}" if refused else ""),
                 **({"vllm_refuses": True} if refused else {}))
            continue
        try:
            result = verify_plan(plan, model=str(config_dir), seed=1)
            reason = "" if not result.mismatches else f"{len(result.mismatches)} mismatches: {', '.join(result.mismatches[:3])}"
        except Exception as exc:
            reason = f"verify-plan: {_line(exc)}"
        emit(label, compiled=True, verified=not reason, seconds=round(time.perf_counter() - start, 1), reason=reason)


def vllm_refuses(config_dir: Path, trainer, fmt) -> str:
    """Why vLLM's own loading of this format's checkpoint tensors (random values) fails, or "": DefaultModelLoader's
    steps on a CPU-built model (load_weights, then its check that every parameter was initialized)."""
    import torch
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.compiler.frontend.vllm_patches import host_independent

    vllm_config = make_vllm_config(config_dir)
    try:
        with host_independent(), torch.no_grad():
            model = build_model(vllm_config, "cpu")
            tensors = ((s.name, torch.randn(s.shape).to(getattr(torch, s.dtype))) for s in trainer.specs(fmt))
            loaded = model.load_weights(trainer.checkpoint_tensors(fmt, tensors))
            if loaded is not None:
                DefaultModelLoader(vllm_config.load_config).track_weights_loading(model, set(loaded))
    except Exception as exc:
        return _line(exc)
    return ""


def _line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model types (default: the whole zoo)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--one", nargs=2, metavar=("TYPE", "ARCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="weightplan-sweep-"))
    if args.one:
        run_one(*args.one, workdir)
        return 0
    only = set(filter(None, args.only.split(",")))
    rows = []
    for model_type, architecture in zoo():
        if only and model_type not in only:
            continue
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", model_type, architecture, "--workdir", str(workdir)],
                                  capture_output=True, text=True, timeout=args.timeout)
            found = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("SWEEP ")]
            if not found:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                found = [{"model_type": model_type, "architecture": architecture, "format": "-", "compiled": False,
                          "verified": False, "seconds": 0.0, "reason": f"process exited {proc.returncode}: {tail[:300]}"}]
        except subprocess.TimeoutExpired:
            found = [{"model_type": model_type, "architecture": architecture, "format": "-", "compiled": False,
                      "verified": False, "seconds": args.timeout, "reason": f"timed out after {args.timeout:.0f} s"}]
        for row in found:
            rows.append(row)
            print(f"{row['architecture']:<32} {row['format']:<16} compiled={'yes' if row['compiled'] else 'no ':<3} "
                  f"verified={'yes' if row['verified'] else 'no ':<3} {row['seconds']:6.1f}s  {row.get('reason', '')}", flush=True)
    unbuildable = [r for r in rows if r.get("unbuildable")]
    refused = [r for r in rows if r.get("vllm_refuses")]
    failures = [f"{r['architecture']}/{r['format']}: {r['reason']}" for r in rows
                if not r["verified"] and not r.get("unbuildable") and not r.get("vllm_refuses")]
    print(json.dumps({"attempted": len(rows) - len(unbuildable) - len(refused), "compiled": sum(r["compiled"] for r in rows),
                      "verified": sum(r["verified"] for r in rows), "failures": failures,
                      "vllm_cpu_cannot_build": [f"{r['architecture']}: {r['reason']}" for r in unbuildable],
                      "vllm_cannot_load": [f"{r['architecture']}/{r['format']}: {r['reason']}" for r in refused],
                      "multimodal_not_swept": [arch for _, arch in multimodal_zoo()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
