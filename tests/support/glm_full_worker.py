"""A child process of tests/e2e/test_glm_full.py: one full-size GLM-5.2 compile or sampled verify, reported as one JSON line.

Each full-size step runs in its own process so that no process holds more than one of them and the test
process stays small; the line carries the child's peak resident memory.
Usage: python tests/support/glm_full_worker.py compile INDEX OUT | verify PLAN SAMPLE SEED [RANK,RANK,...]
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path


def compile_one(index: int, out: Path) -> dict:
    from weightplan.compiler.cli import quiet_vllm
    from weightplan.compiler.compile import compile_plan, default_plan_path
    from weightplan.compiler.make_plans import CHECKED_IN

    quiet_vllm()
    options = CHECKED_IN[index]
    result = compile_plan(options.__class__(**{**options.__dict__, "output": out}))
    origin = result.program.origin
    return {"stats": result.stats, "checked_in": str(default_plan_path("glm-5.2", origin.trainer, origin.inference, options.quant))}


def verify_one(plan: Path, sample: int, seed: int, ranks: list[int] | None) -> dict:
    from weightplan.compiler.cli import quiet_vllm
    from weightplan.compiler.verify_plan import verify_plan

    quiet_vllm()
    result = verify_plan(plan, sample=sample, seed=seed, ranks=ranks)
    return {"mismatches": list(result.mismatches), "tensors": result.tensors, "compared": list(result.compared)}


def main(argv: list[str]) -> None:
    if argv[0] == "compile":
        report = compile_one(int(argv[1]), Path(argv[2]))
    else:
        ranks = [int(r) for r in argv[4].split(",")] if len(argv) > 4 else None
        report = verify_one(Path(argv[1]), int(argv[2]), int(argv[3]), ranks)
    report["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
