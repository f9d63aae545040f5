"""Probe: does this vLLM's CPU platform run a `pipeline_parallel_size=2` engine? (evidence for docs/vllm.md).

Usage: python benchmarks/probe_pp_engine.py [--pp 2]

Starts `vllm.LLM` on tests/configs/engine-llama (dummy weights, eager, one CPU per worker, AMX off as in the engine
tests) with the given pipeline size and asks for one greedy generation. Last line JSON: {"pp", "started",
"generated", "error"}; exit 0 either way (it reports, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2)
    args = p.parse_args()
    from weightplan.testing.engines import greedy, make_llm, pin_no_amx, shutdown

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.pp)))
    pin_no_amx(Path(tempfile.mkdtemp(prefix="weightplan-pp-probe-")))
    result = {"pp": args.pp, "started": False, "generated": False, "error": None}
    llm = None
    try:
        llm = make_llm(ROOT / "tests" / "configs" / "engine-llama", dummy=True, backend=False, pipeline_parallel_size=args.pp)
        result["started"] = True
        result["generated"] = bool(greedy(llm)[0][0])
    except Exception as exc:  # the probe's answer, not a failure of the probe (the workers' tracebacks are on stderr)
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if llm is not None:
            shutdown(llm)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
