"""phase(): accumulate a compile phase's wall time and CPU time into a timings dict."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def phase(timings: dict, name: str):
    """Add the block's wall seconds to timings[name] and its process CPU seconds to timings[name + '_cpu']."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - wall
        timings[f"{name}_cpu"] = timings.get(f"{name}_cpu", 0.0) + time.process_time() - cpu
