"""phase(): accumulate a compile phase's wall time and CPU time into a timings dict."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def phase(timings: dict, name: str):
    """Add the block's wall seconds to timings[name] and its process CPU seconds to timings[name + '_cpu']."""
    started = clock()
    try:
        yield
    finally:
        add(timings, name, started)


def clock() -> tuple[float, float]:
    """Now, as (wall, CPU) seconds."""
    return time.perf_counter(), time.process_time()


def add(timings: dict, name: str, started: tuple[float, float]) -> None:
    """Add the wall and CPU seconds since `started` (from clock()) to timings[name] and timings[name + '_cpu']."""
    wall, cpu = clock()
    timings[name] = timings.get(name, 0.0) + wall - started[0]
    timings[f"{name}_cpu"] = timings.get(f"{name}_cpu", 0.0) + cpu - started[1]
