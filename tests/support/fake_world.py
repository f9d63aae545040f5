"""DTensor code under torch's fake process group, run in a fresh process: the one-process gloo world that
vLLM's tracing sets up in the test process must stay untouched."""

from __future__ import annotations

import multiprocessing

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def run_in_fresh_process(fn, *args) -> None:
    """Call `fn(*args)` (a module-level function) in a spawned process; fail if it raises."""
    process = multiprocessing.get_context("spawn").Process(target=fn, args=args)
    process.start()
    process.join()
    assert process.exitcode == 0, f"{fn.__name__} failed in its own process (its traceback is in the captured stderr)"


def as_rank(rank: int, world: int) -> None:
    """Make this process rank `rank` of a fake `world`-rank process group."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
