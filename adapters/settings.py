"""What every RL framework adapter's settings share: the plan, the rendezvous store and the sync options."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PublishSettings:
    """`plan`: a compiled plan, or None to compile one from the live model. `address`: the rendezvous store trainer
    rank 0 hosts (port 0: a free one). `job`: the job id (each adapter defaults to its framework's name). `timeout`,
    `verify`, `delta`: as the vLLM backend's (docs/vllm.md). `workdir`: where the trainer layout and the compiled plan go
    (default a temporary directory; inference processes on other hosts need it shared)."""

    plan: str | None = None
    address: str = "127.0.0.1:0"
    job: str = "weightplan"
    timeout: float = 120.0
    verify: bool = False
    delta: float = 0.0
    workdir: str | None = None
