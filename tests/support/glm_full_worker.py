"""A child process of tests/e2e/test_glm_full.py: one full-size GLM-5.2 compile or sampled verify, reported as one JSON line.

Each full-size step runs in its own process so that no process holds more than one of them and the test
process stays small; the line carries the child's peak resident memory.
Usage: python tests/support/glm_full_worker.py compile|compile-cuda INDEX OUT | verify PLAN SAMPLE SEED [RANK,RANK,...]
(compile-cuda: an index of make_plans.CHECKED_IN_CUDA, in the CUDA venv; verify traces on the plan's own platform)
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


def compile_one(index: int, out: Path, platform: str = "cpu") -> dict:
    from weightplan.compiler.cli import quiet_vllm
    from weightplan.compiler.compile import compile_plan, default_plan_path
    from weightplan.compiler.frontend.cuda_platform import select_platform
    from weightplan.compiler.make_plans import CHECKED_IN, CHECKED_IN_CUDA, CUDA_DEVICE

    quiet_vllm()
    select_platform(platform, CUDA_DEVICE if platform == "cuda" else None, "glm_full_worker")
    options = (CHECKED_IN_CUDA if platform == "cuda" else CHECKED_IN)[index]
    result = compile_plan(options.__class__(**{**options.__dict__, "output": out}))
    origin = result.program.origin
    return {"stats": result.stats, "checked_in": str(default_plan_path("glm-5.2", origin.trainer, origin.inference, options.quant))}


def verify_one(plan: Path, sample: int, seed: int, ranks: list[int] | None) -> dict:
    from weightplan.compiler.cli import quiet_vllm
    from weightplan.compiler.frontend.cuda_platform import select_platform
    from weightplan.runtime import load_plan

    quiet_vllm()
    inference = load_plan(plan).header.inference  # traced on the platform and device the plan was compiled for
    select_platform(inference.platform, (inference.vllm_host or {}).get("device") if inference.platform == "cuda" else None,
                    "glm_full_worker")
    from weightplan.compiler.verify_plan import verify_plan

    result = verify_plan(plan, sample=sample, seed=seed, ranks=ranks)
    return {"mismatches": list(result.mismatches), "tensors": result.tensors, "compared": list(result.compared)}


def main(argv: list[str]) -> None:
    if argv[0] in ("compile", "compile-cuda"):
        report = compile_one(int(argv[1]), Path(argv[2]), "cuda" if argv[0] == "compile-cuda" else "cpu")
    else:
        ranks = [int(r) for r in argv[4].split(",")] if len(argv) > 4 else None
        report = verify_one(Path(argv[1]), int(argv[2]), int(argv[3]), ranks)
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
