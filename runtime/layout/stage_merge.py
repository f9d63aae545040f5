"""One layout file for a pipeline-parallel trainer: the stage modules' descriptions merged, gathered over torch.distributed.

Each pipeline stage's module holds only its tensors (DTensors on the stage's sub-mesh, whose ranks
are global trainer ranks), so `describe_layout` of one stage describes one stage. `merge_stage_layouts`
joins the stages' descriptions into one layout with `"pp"` (a tied embedding described by the first
and the last stage becomes one tensor, Replicate() over a leading mesh dim of one slice per stage, as
`--trainer pp=` lays it out) and checks it (runtime/layout/stages.py). `write_pipeline_layout`, called
on every trainer rank, gathers the descriptions as JSON bytes to rank 0, which merges and writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import LayoutError
from .layout_file import describe_layout, parse_trainer_layout, write_layout_object
from .module_tensors import trainer_tensors


def merge_stage_layouts(stages: list[dict], where: str = "the pipeline stages") -> dict:
    """One layout object from the `describe_layout` objects of a trainer's stages (several ranks of a stage may give the
    same object); LayoutError, in one line after `where`, for stages that overlap, are not blocks of ranks or disagree."""
    unique = list({json.dumps(d, sort_keys=True): d for d in stages}.values())
    parsed = [parse_trainer_layout(d, f"{where} (stage description {i})", stage=True) for i, d in enumerate(unique)]
    worlds = sorted({p.world_size for p in parsed})
    if len(worlds) > 1:
        raise LayoutError(f"{where}: stage descriptions give world_size {worlds[0]} and {worlds[1]}; describe every stage "
                          "with the trainer's world size")
    world = worlds[0]
    held = [sorted({r for t in p.tensors.values() for r in t.sharding.mesh.ranks}) for p in parsed]
    for i, mine in enumerate(held):
        for j in range(i):
            common = sorted(set(mine) & set(held[j]))
            if common:
                raise LayoutError(f"{where}: two different stage descriptions both place tensors on trainer rank "
                                  f"{common[0]}, so the stages overlap; each pipeline stage holds its own ranks")
    order = sorted(range(len(unique)), key=lambda i: held[i][0] if held[i] else world)
    pp = len(order)
    if pp == 1:
        return unique[0]
    per_stage = world // pp
    for stage, i in enumerate(order):
        block = list(range(stage * per_stage, (stage + 1) * per_stage))
        if world % pp or held[i] != block:
            raise LayoutError(f"{where}: stage {stage} of {pp} holds trainer ranks {_ranks_text(held[i])}; pipeline stages "
                              f"are equal blocks of consecutive ranks in stage order (torchtitan's mesh puts pp outermost), "
                              f"so with world_size {world} stage {stage} would be ranks {_ranks_text(block)}")
    merged = _joined([unique[i] for i in order], world, pp, where)
    parse_trainer_layout(merged, where)  # the checks a layout file with "pp" gets when it is read
    return merged


def _joined(stages: list[dict], world: int, pp: int, where: str) -> dict:
    """The stages' tensors under one table of meshes; a tensor several stages describe alike is replicated over them."""
    entries: dict[str, list[tuple[int, dict, dict]]] = {}
    for stage, data in enumerate(stages):
        for name, entry in data["tensors"].items():
            entries.setdefault(name, []).append((stage, entry, data["meshes"][entry["mesh"]]))
    meshes: dict[str, int] = {}
    tensors = {}
    for name, held in entries.items():
        (first, entry, mesh), rest = held[0], held[1:]
        for stage, other, other_mesh in rest:
            if ({k: other[k] for k in ("shape", "dtype", "placements")} != {k: entry[k] for k in ("shape", "dtype", "placements")}
                    or other_mesh["shape"] != mesh["shape"]):
                raise LayoutError(f"{where}: stages {first} and {stage} both hold tensor {name!r} but lay it out "
                                  "differently; a tied tensor needs the same shape, dtype, mesh shape and placements on each")
        if rest:
            mesh = {"shape": [len(held), *mesh["shape"]], "ranks": [m["ranks"] for _, _, m in held]}
            entry = {**entry, "placements": ["Replicate()", *entry["placements"]]}
        key = json.dumps(mesh)
        tensors[name] = {**entry, "mesh": meshes.setdefault(key, len(meshes))}
    return {"format": stages[0]["format"], "version": stages[0]["version"], "world_size": world, "pp": pp,
            "meshes": [json.loads(m) for m in meshes], "tensors": tensors}


def write_pipeline_layout(stage_module: torch.nn.Module, path: str | Path) -> Path:
    """Write one layout file for a pipeline-parallel trainer; call it on every trainer rank with that rank's stage module.

    Collective over the default process group (the trainer's ranks): each rank's description goes to rank 0 as JSON
    bytes; rank 0 merges the stages' descriptions and writes the file. Every rank returns the path, or raises the same
    LayoutError if the stages do not merge (nothing is written). Plain tensors of a stage (e.g. FSDP2's unsharded
    buffers) are held whole by the stage's ranks: the ranks of its DTensors' meshes, and this rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    tensors = trainer_tensors(stage_module)
    ranks = sorted({rank} | {r for t in tensors.values() if isinstance(t, DTensor) for r in t.device_mesh.mesh.reshape(-1).tolist()})
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = json.dumps(describe_layout(tensors, world_size=world, plain_ranks=ranks)).encode()
    texts = _gather_bytes(mine, rank, world, device)
    error = b""
    if rank == 0:
        try:
            write_layout_object(merge_stage_layouts([json.loads(t) for t in texts]), path)
        except LayoutError as exc:
            error = str(exc).encode()
    error = _broadcast_bytes(error, rank, device)
    if error:
        raise LayoutError(error.decode())
    return Path(path)


def _gather_bytes(data: bytes, rank: int, world: int, device: torch.device) -> list[bytes]:
    """Every rank's `data` on rank 0 (an empty list elsewhere): sizes all-gathered, then the bytes padded to the longest."""
    import torch.distributed as dist

    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    return [bytes(g[:int(n)].cpu().numpy()) for g, n in zip(gathered, sizes)] if rank == 0 else []


def _broadcast_bytes(data: bytes, rank: int, device: torch.device) -> bytes:
    """Rank 0's `data` on every rank."""
    import torch.distributed as dist

    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buffer = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if rank == 0 and data:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=0)
    return bytes(buffer.cpu().numpy())


def _ranks_text(ranks: list[int]) -> str:
    return "none" if not ranks else f"{ranks[0]}..{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)
