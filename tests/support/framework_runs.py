"""One `bench_frameworks.py --smoke` run per test session, kept for every test that checks it.

The TRL and verl runs start four trainer processes and vLLM engines each; the benchmark's smoke test and the framework
tests (tests/frameworks/test_trl.py, test_verl.py) prove their things from the same run rather than start them again:
the smoke test its JSON line, the framework tests each step's digests and generations. Fresh reference engines for
every step's checkpoint of both frameworks run in one process afterwards (one engine per checkpoint, as before).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from weightplan.testing.engines import pin_no_amx, read_references, start_references

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3  # bench_frameworks.py --smoke
TIMEOUT = 1500


@dataclass(frozen=True)
class FrameworkRuns:
    """The smoke run's JSON line, its stdout, where each framework's weightplan run left its files
    (`runs["trl"]`: TRL's trainers' step-S-rank-R.json; `runs["verl"]`: step-S.json and the rollout's log), and the
    greedy outputs of fresh engines on each framework's step checkpoints (`references[framework][step]`)."""

    figures: dict
    stdout: str
    runs: dict[str, Path]
    references: dict[str, dict[int, list]]


def run_frameworks(tmp: Path) -> FrameworkRuns:
    workdir = tmp / "bench"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_frameworks.py"), "--smoke", "--workdir",
                           str(workdir)], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, f"bench_frameworks.py exited with {done.returncode}:\n{done.stdout[-2000:]}\n" \
                                 f"{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench_frameworks.py printed nothing:\n{done.stderr[-3000:]}"
    runs = {framework: workdir / framework / "weightplan" for framework in ("trl", "verl")}
    checkpoints = {f"{framework}-{step}": run / f"checkpoint-{step}" for framework, run in runs.items()
                   for step in range(1, STEPS + 1)}
    unpin = pin_no_amx(tmp)
    try:
        proc = start_references(checkpoints, tmp / "refs.json", tmp / "refs.log")
        found = read_references(proc, tmp / "refs.json", tmp / "refs.log", timeout=TIMEOUT)
    finally:
        unpin()
    references = {framework: {step: [tuple(p) for p in found[f"{framework}-{step}"]] for step in range(1, STEPS + 1)}
                  for framework in runs}
    return FrameworkRuns(json.loads(lines[-1]), done.stdout, runs, references)
