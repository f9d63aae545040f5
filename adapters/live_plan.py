"""The adapters' shared trainer-side steps: compile the live model's plan at the first sync, broadcast rank 0's records.

Rank 0's records (the plan's path, the store's address) go to the other ranks as JSON bytes, never pickle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

# The launcher's variables a compile child must not see: vLLM would join this trainer's process group.
_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def compile_live_plan(shards, model: str, inference: str, workdir: str | Path | None, name: str) -> str:
    """The plan of the live trainer `shards` (a module, or (name, tensor) pairs of DTensors) against `inference`,
    written to workdir/`name` by `compile-plan --trainer-format stacked` in a child process: vLLM's model-parallel
    state, which the compiler sets up for one process, must not meet this process's trainer group. No `workdir` (the
    settings' default): a new temporary directory, weightplan-<name's stem>-*."""
    from weightplan.runtime import write_trainer_layout

    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"weightplan-{Path(name).stem}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    layout = write_trainer_layout(shards, workdir / "trainer-layout.json")
    tensors = shards.state_dict().values() if isinstance(shards, torch.nn.Module) else (t for _, t in shards)
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[next(t for t in tensors if t.is_floating_point()).dtype]
    out = workdir / name
    args = ["--model", model, "--trainer-format", "stacked", "--trainer-dtype", dtype, "--trainer-layout", str(layout),
            "--inference", inference, "-o", str(out)]
    code = "import sys; from weightplan.compiler.cli import compile_main; sys.exit(compile_main())"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"compile-plan {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return str(out)


def broadcast_json(obj: dict, device) -> dict:
    """Rank 0's JSON object on every rank (two broadcasts over the default group: length, then UTF-8 bytes)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return json.loads(bytes(data.cpu().tolist()).decode())


def group_device() -> torch.device:
    """Where the default group's collectives run: the CPU for gloo (or no group), else the accelerator."""
    return torch.device("cpu") if not dist.is_initialized() or dist.get_backend() == "gloo" else torch.device(torch.accelerator.current_accelerator())
