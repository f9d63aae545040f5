"""The runtime reads plans only: no module under runtime/ imports weightplan.compiler (or vLLM), directly or not."""

from __future__ import annotations

import subprocess
import sys


def test_every_runtime_module_imports_without_the_compiler():
    code = ("import importlib, pkgutil, sys, weightplan.runtime as r\n"
            "names = [m.name for m in pkgutil.walk_packages(r.__path__, 'weightplan.runtime.')]\n"
            "for name in names: importlib.import_module(name)\n"
            "assert len(names) > 30, names\n"
            "bad = [m for m in sys.modules if m.startswith(('weightplan.compiler', 'vllm'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
