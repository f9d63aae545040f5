"""A pass-timing observer for the pipeline's runners (tests only)."""

from __future__ import annotations

from weightplan.compiler.ir import Program
from weightplan.compiler.passes.pipeline import Observer


def timer(timings: dict[str, float]) -> Observer:
    """An observer adding each pass's wall time to `timings[name]`."""

    def observe(name: str, program: Program, seconds: float) -> None:
        timings[name] = timings.get(name, 0.0) + seconds

    return observe
