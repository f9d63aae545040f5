"""The wheel a user installs: every module of compiler/, runtime/, vllm_backend/, adapters/ and testing/ in it, no test or
benchmark, and each imports from it alone (the `wheel` fixture: conftest.py)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAPPED = ("compiler", "runtime", "vllm_backend", "adapters", "testing")  # setup.py installs each as weightplan.<folder>


def _source_modules() -> set[str]:
    """The wheel paths of every Python file of the package's source folders."""
    paths = {"weightplan/__init__.py"}
    for folder in MAPPED:
        for path in (ROOT / folder).rglob("*.py"):
            paths.add(f"weightplan/{folder}/{path.relative_to(ROOT / folder).as_posix()}")
    return paths


def test_the_wheel_holds_every_module_and_no_test_or_benchmark(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    python = {n for n in names if n.endswith(".py")}
    assert python == _source_modules(), (sorted(_source_modules() - python)[:5], sorted(python - _source_modules())[:5])
    assert any(n.startswith("weightplan/runtime/delta/") for n in python)
    assert not [n for n in names if n.split("/")[0] in ("tests", "benchmarks", "examples")]
    assert "weightplan/compiler/configs/glm-5.2/config.json" in names
    assert "weightplan/compiler/simulate/clusters/dgx-h200-seed.json" in names
    assert "weightplan/testing/configs/tiny-deepseek-v3/config.json" in names


def test_every_module_imports_from_the_wheel_alone(wheel, tmp_path):
    """A fresh interpreter without site processing (so the editable install's path hook is absent), the unpacked wheel
    first on sys.path and the venv's third-party packages after it: every module imports, and from the wheel."""
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    modules = sorted(p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in _source_modules())
    code = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(unpacked)!r}]\n"
        f"sys.path.append({sysconfig.get_paths()['purelib']!r})\n"
        f"failed = []\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        module = importlib.import_module(name)\n"
        f"        assert module.__file__.startswith({str(unpacked)!r}), module.__file__\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print(len(failed), 'failed'); print('\\n'.join(failed[:10]))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
