"""The weightplan compiler: trace vLLM loading, run passes, write plan files."""

import importlib

# The public API, imported on first use: importing the package must not import vLLM. (The
# verify_plan function is not here: its module has the same name and would shadow it.)
_PUBLIC = {
    "CompileOptions": "compile",
    "CompileResult": "compile",
    "compile_plan": "compile",
    "default_plan_path": "compile",
    "VerifyResult": "verify_plan",
    "summarize": "plan_summary",
    "render_text": "plan_summary",
    "known_models": "models",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
