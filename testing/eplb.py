"""EPLB references for tests and the soak: vLLM's own balancer's tables, and the bytes each rank holds under a table."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from weightplan.runtime.tables.eplb import initial_arrangement

from .runtime_worker import host_reference

MAP_FILE = "expert-map-{version}.json"  # the table an EPLB engine serves with from `version` on (soak, plain readers)


def initial_table(plan) -> np.ndarray:
    """vLLM's initial [MoE layers, physical slots] table (EplbState.add_model repeats one row per layer)."""
    eplb = plan.header.inference.eplb
    return np.tile(initial_arrangement(eplb), (len(eplb.layers), 1))


def vllm_rebalanced(plan, seed: int) -> np.ndarray:
    """The table vLLM's default EPLB policy makes for random expert loads (what its balancer commits in a live engine)."""
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    eplb = plan.header.inference.eplb
    load = torch.rand(len(eplb.layers), eplb.logical_experts, generator=torch.Generator().manual_seed(seed)) * 100
    table = DefaultEplbPolicy.rebalance_experts(load, eplb.physical_experts, 1, 1, plan.header.dst_ranks)
    return table.numpy().astype(np.int64)


def eplb_reference(plan, full: dict[str, torch.Tensor], rank: int, table: np.ndarray) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors under `table`: the host executor's (vLLM's initial arrangement, which verify-plan proves
    equal to vLLM's load), each expert slot holding what the first slot that initially held its logical expert holds."""
    eplb = plan.header.inference.eplb
    local = eplb.physical_experts // plan.header.dst_ranks
    first: dict[int, int] = {}
    for slot, expert in enumerate(initial_arrangement(eplb).tolist()):
        first.setdefault(expert, slot)
    initial = {r: host_reference(plan, full, r) for r in range(plan.header.dst_ranks)}
    out = {n: t.clone() for n, t in initial[rank].items()}
    for layer, names in enumerate(eplb.layers):
        for s in range(local):
            holder, at = divmod(first[int(table[layer, rank * local + s])], local)
            for name in names:
                out[name][s] = initial[holder][name][at]
    return out


def write_table(directory: Path, version: int, table: np.ndarray) -> Path:
    """Write the table engines serve with from `version` on (JSON, atomically: a reader never sees half a file)."""
    path = Path(directory) / MAP_FILE.format(version=version)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table.tolist()))
    os.replace(tmp, path)
    return path


def read_table(directory: str | os.PathLike, version: int) -> np.ndarray | None:
    """The table written for `version` exactly, or None."""
    path = Path(directory) / MAP_FILE.format(version=version)
    return np.array(json.loads(path.read_text()), dtype=np.int64) if path.exists() else None


def latest_table(directory: str | os.PathLike, version: int, plan) -> np.ndarray:
    """The table in force at `version`: the last one written for a version up to it, else vLLM's initial one."""
    written = sorted((int(p.stem.rsplit("-", 1)[1]), p) for p in Path(directory).glob(MAP_FILE.format(version="*")))
    chosen = [v for v, _ in written if v <= version]
    return read_table(directory, chosen[-1]) if chosen else initial_table(plan)
