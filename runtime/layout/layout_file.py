"""The trainer layout file (--trainer-layout): read and check it, or write it from a live DTensor model.

    {"format": "weightplan-trainer-layout", "version": 1, "world_size": 4, ["pp": 2,]
     "meshes": [{"shape": [2, 2], "ranks": [[0, 1], [2, 3]]}, ...],
     "tensors": {"<name>": {"shape": [...], "dtype": "bfloat16", "mesh": 0,
                            "placements": ["Shard(0)", "Replicate()"]}, ...}}

See docs/trainer-layout.md. Reading parses JSON only; nothing is evaluated.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LayoutError
from ..files import read_json_file
from ..files import write_atomically
from ..dtypes import DTYPE_SIZES
from .module_tensors import trainer_tensors
from .placements import Mesh, Placement, Sharding, mesh_boxes
from .shards import MAX_RANKS
from .stages import check_stages

FORMAT = "weightplan-trainer-layout"
VERSION = 1


@dataclass(frozen=True)
class TensorLayout:
    """One trainer tensor in a layout file: global shape, dtype, and its mesh and placements."""

    shape: tuple[int, ...]
    dtype: str
    sharding: Sharding


@dataclass(frozen=True)
class TrainerLayoutFile:
    path: str
    world_size: int
    tensors: dict[str, TensorLayout]
    pp: int | None = None  # pipeline stages (runtime/layout/stages.py); None: one stage


def read_trainer_layout(path: str | Path) -> TrainerLayoutFile:
    """Read a layout file and check it on its own; LayoutError names the defect and where it is."""
    data = read_json_file(path, LayoutError, "trainer layout", object_pairs_hook=lambda pairs: _unique_keys(path, pairs))
    return parse_trainer_layout(data, path)


def parse_trainer_layout(data, path: str | Path, *, stage: bool = False) -> TrainerLayoutFile:
    """Check a layout's JSON object (from a file, or `describe_layout` of a live model); `path` names it in errors.

    With `stage`, the layout is one pipeline stage's module: the ranks of other stages hold none of its tensors."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise LayoutError(f"{path} is not a weightplan trainer layout: expected \"format\": \"{FORMAT}\", \"version\": {VERSION}")
    world = data.get("world_size")
    meshes, tensors = data.get("meshes"), data.get("tensors")
    if type(world) is not int or not 1 <= world <= MAX_RANKS or not isinstance(meshes, list) or not isinstance(tensors, dict):
        raise LayoutError(f"trainer layout {path} needs \"world_size\" (an integer in 1..{MAX_RANKS}, the most trainer ranks a "
                          f"plan holds; it is {str(world)[:40]}), \"meshes\" (a list) and \"tensors\" (an object)")
    parsed = [_mesh(path, i, m, world) for i, m in enumerate(meshes)]
    layouts = {name: _tensor(path, name, entry, parsed) for name, entry in tensors.items()}
    missing = sorted(set(range(world)) - {r for t in layouts.values() for r in t.sharding.mesh.ranks})
    if missing and not stage:
        raise LayoutError(f"trainer layout {path}: trainer rank {missing[0]} of world_size {world} holds no tensor "
                          "(it is in no mesh a tensor uses); mesh rank ids must be the global trainer ranks 0..world_size-1")
    pp = data.get("pp")
    if pp is not None:
        if type(pp) is not int or not 2 <= pp <= world:
            raise LayoutError(f"trainer layout {path}: \"pp\" is {str(pp)[:40]}, not a number of pipeline stages in "
                              f"2..world_size ({world}); leave it out for a trainer without pipeline stages")
        check_stages({name: t.sharding for name, t in layouts.items()}, world, pp, f"trainer layout {path}")
    return TrainerLayoutFile(str(path), world, layouts, pp)


def _unique_keys(path, pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise LayoutError(f"trainer layout {path}: {key!r} appears twice in one object; each tensor needs exactly one entry")
        seen[key] = value
    return seen


def _mesh(path, index: int, mesh, world: int) -> Mesh:
    where = f"trainer layout {path}: mesh {index}"
    shape = mesh.get("shape") if isinstance(mesh, dict) else None
    if not isinstance(shape, list) or not shape or not all(type(n) is int and n >= 1 for n in shape):
        raise LayoutError(f"{where} needs \"shape\" (a non-empty list of sizes >= 1) and \"ranks\" (DeviceMesh.mesh.tolist())")
    try:
        parsed = Mesh.from_json(shape, mesh.get("ranks"))
    except ValueError as exc:
        raise LayoutError(f"{where}: {exc}, so part of its tensors would have no holder; write DeviceMesh.mesh.tolist()") from None
    for rank in parsed.ranks:
        if not 0 <= rank < world:
            raise LayoutError(f"{where} names trainer rank {rank}, outside world_size {world}; "
                              "mesh rank ids must be global trainer ranks")
    if len(set(parsed.ranks)) < len(parsed.ranks):
        twice = next(r for r in parsed.ranks if parsed.ranks.count(r) > 1)
        raise LayoutError(f"{where} lists trainer rank {twice} at two coordinates, so its shards would overlap; "
                          "each mesh coordinate must be a distinct rank")
    return parsed


def _tensor(path, name: str, entry, meshes: list[Mesh]) -> TensorLayout:
    where = f"trainer layout {path}: tensor {name!r}"
    if not isinstance(entry, dict) or set(entry) != {"shape", "dtype", "mesh", "placements"}:
        raise LayoutError(f"{where} needs exactly the keys shape, dtype, mesh and placements")
    shape, dtype, mesh, placements = entry["shape"], entry["dtype"], entry["mesh"], entry["placements"]
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise LayoutError(f"{where}: shape {shape!r} is not a list of sizes")
    if dtype not in DTYPE_SIZES:
        raise LayoutError(f"{where}: unknown dtype {dtype!r}; use one of {', '.join(DTYPE_SIZES)}")
    if type(mesh) is not int or not 0 <= mesh < len(meshes):
        raise LayoutError(f"{where} names mesh {mesh!r}; the file has meshes 0..{len(meshes) - 1}")
    if not isinstance(placements, list) or not all(isinstance(p, str) for p in placements):
        raise LayoutError(f"{where}: placements must be a list of strings like \"Shard(0)\"")
    try:
        sharding = Sharding(meshes[mesh], tuple(Placement.parse(p) for p in placements))
        mesh_boxes(sharding, tuple(shape))
    except ValueError as exc:
        raise LayoutError(f"{where}: {exc}") from None
    return TensorLayout(tuple(shape), dtype, sharding)


def write_trainer_layout(tensors, path: str | Path, *, world_size: int | None = None) -> Path:
    """Write the layout of a live trainer: a module (its trainer tensors, see `describe_layout`) or (name, tensor) pairs.

    DTensors give their global shape, dtype, device_mesh.mesh and placements. Plain tensors (e.g.
    FSDP2's unsharded buffers) are written as replicated on every rank of `world_size`
    (default: torch.distributed's world size, else 1 + the highest rank of any mesh).
    Partial placements are refused.
    """
    return write_layout_object(describe_layout(tensors, world_size=world_size), path)


def write_layout_object(data: dict, path: str | Path) -> Path:
    """Write a layout's JSON object (`describe_layout`'s form) atomically, one tensor per line."""
    lines = [f"  {json.dumps(name)}: {json.dumps(entry)}" for name, entry in data["tensors"].items()]
    pp = f', "pp": {data["pp"]}' if data.get("pp") else ""
    text = (f'{{"format": "{FORMAT}", "version": {VERSION}, "world_size": {data["world_size"]}{pp},\n "meshes": [\n  '
            + ",\n  ".join(json.dumps(m) for m in data["meshes"]) + '\n ],\n "tensors": {\n' + ",\n".join(lines) + "\n }\n}\n")
    return write_atomically(path, text.encode(), LayoutError, "trainer layout")


def describe_layout(tensors, *, world_size: int | None = None, plain_ranks: list[int] | None = None) -> dict:
    """The layout file's JSON object for a live trainer (what write_trainer_layout writes).

    A module gives its trainer tensors (runtime/layout/module_tensors.py `trainer_tensors`: state-dict names
    without wrapper prefixes, FSDP2's sharded parameters, persistent buffers, tied tensors once). Plain tensors are
    held whole by `plain_ranks` (default: every rank; a pipeline stage's: its own ranks).
    """
    from torch.distributed.tensor import DTensor

    items = list(_named(tensors))
    if world_size is None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            world_size = torch.distributed.get_world_size()
        else:
            world_size = 1 + max((max(t.device_mesh.mesh.reshape(-1).tolist()) for _, t in items if isinstance(t, DTensor)), default=0)
    meshes: dict[str, int] = {}
    entries = {}
    for name, tensor in items:
        if name in entries:
            raise LayoutError(f"tensor {name!r} is given twice; each trainer tensor needs exactly one entry")
        if isinstance(tensor, DTensor):
            grid = tensor.device_mesh.mesh
            shape, ranks = list(grid.shape), grid.tolist()
            placements = [_placement(name, p, tensor.ndim, i) for i, p in enumerate(tensor.placements)]
        else:
            ranks = list(range(world_size)) if plain_ranks is None else list(plain_ranks)
            shape, placements = [len(ranks)], ["Replicate()"]
        mesh = json.dumps({"shape": shape, "ranks": ranks})
        entries[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                         "mesh": meshes.setdefault(mesh, len(meshes)), "placements": placements}
    return {"format": FORMAT, "version": VERSION, "world_size": world_size,
            "meshes": [json.loads(m) for m in meshes], "tensors": entries}


def _named(tensors) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(tensors, torch.nn.Module):
        yield from trainer_tensors(tensors).items()
    else:
        yield from (tensors.items() if isinstance(tensors, Mapping) else tensors)


def _placement(name: str, placement, ndim: int, mesh_dim: int) -> str:
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    if isinstance(placement, _StridedShard):
        return str(Placement("strided", placement.dim % max(ndim, 1), int(placement.split_factor)))
    if isinstance(placement, Shard):
        return str(Placement("shard", placement.dim % max(ndim, 1)))
    if isinstance(placement, Replicate):
        return "Replicate()"
    raise LayoutError(f"tensor {name!r} has placement {placement!r} on mesh dim {mesh_dim}; only Shard, Replicate and "
                      "_StridedShard describe stored weights. Redistribute it (e.g. to Replicate()) before writing its layout")
