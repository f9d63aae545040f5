"""The runtime reads plans only: no module under runtime/ imports weightplan.compiler (or vLLM), directly or not; its
parts import only downwards, and without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_every_runtime_module_imports_without_the_compiler():
    code = ("import importlib, pkgutil, sys, weightplan.runtime as r\n"
            "names = [m.name for m in pkgutil.walk_packages(r.__path__, 'weightplan.runtime.')]\n"
            "for name in names: importlib.import_module(name)\n"
            "assert len(names) > 30, names\n"
            "bad = [m for m in sys.modules if m.startswith(('weightplan.compiler', 'vllm'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# runtime/'s parts, lowest first: a module may import its own part, a lower layer, or the top-level modules
# (errors, dtypes, casts, checks, constant_writes); parts of one layer import each other only in the lowest one.
_LAYERS = [("plan", "layout", "fp8"), ("tables",), ("delta",), ("host", "transport"), ("sender", "receiver")]
_RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def _runtime_imports() -> dict[str, set[str]]:
    """{module: runtime modules it imports, at any depth of its code but not under `if TYPE_CHECKING:`}, named from runtime/."""
    files = {}
    for path in _RUNTIME.rglob("*.py"):
        parts = path.relative_to(_RUNTIME).with_suffix("").parts
        package = parts[-1] == "__init__"
        name = parts[:-1] if package else parts
        files[".".join(name)] = (path, name if package else parts[:-1])  # (file, the package its relative imports start in)
    out = {}
    for name, (path, here) in files.items():
        found = set()
        for node in _walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = ".".join([*here[:len(here) - node.level + 1], *([node.module] if node.module else [])])
                for alias in node.names:
                    sub = f"{base}.{alias.name}".lstrip(".")
                    found.add(sub if sub in files else base)
        out[name] = found - {""}
    return out


def _walk(node):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            continue
        yield child
        yield from _walk(child)


def _layer(part: str) -> int | None:
    return next((i for i, parts in enumerate(_LAYERS) if part in parts), None)


def test_runtime_parts_import_only_downwards():
    imports = _runtime_imports()
    assert "layout.layout_file" in imports and "sender.sender" in imports, sorted(imports)
    bad = []
    for module, targets in imports.items():
        mine = _layer(module.split(".")[0]) if "." in module else None
        for target in targets:
            theirs = _layer(target.split(".")[0]) if "." in target else None
            if mine is None or theirs is None or module.split(".")[0] == target.split(".")[0]:
                continue
            if theirs > mine or (theirs == mine and mine > 0):
                bad.append(f"{module} -> {target}")
    assert not bad, bad


def test_no_import_cycles_inside_the_runtime():
    imports = _runtime_imports()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(imports.get(module, ())):
            if state.get(target) == 1:
                cycles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(imports):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
