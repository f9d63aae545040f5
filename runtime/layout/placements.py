"""DTensor placements on a device mesh, and the box of a tensor each rank holds (torch's DTensor semantics)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache

Box = tuple[tuple[int, int], ...]  # [start, stop) per tensor dim

_SHARD = re.compile(r"^Shard\((?:dim=)?(\d{1,3})\)$")
_STRIDED = re.compile(r"^_StridedShard\((?:dim=)?(\d{1,3}), *(?:split_factor|sf)=(\d{1,5})\)$")
MAX_SPLIT_FACTOR = 4096  # a split factor is a product of mesh sizes, so at most the 4096 ranks a plan holds
PLACEMENT_FORMS = f"Shard(d), Replicate() or _StridedShard(d, split_factor=k) with k in 1..{MAX_SPLIT_FACTOR}"


@dataclass(frozen=True)
class Placement:
    """One mesh dim's placement: Shard(dim), Replicate(), or _StridedShard(dim, split_factor)."""

    kind: str  # "shard", "replicate" or "strided"
    dim: int = 0
    split_factor: int = 1

    @staticmethod
    def parse(text: str) -> "Placement":
        """Parse the canonical text (torch's repr `Shard(dim=0)`, `_StridedShard(dim=0, sf=2)` too)."""
        if text == "Replicate()":
            return REPLICATE
        if m := _SHARD.match(text):
            return Placement("shard", int(m[1]))
        if (m := _STRIDED.match(text)) and 1 <= int(m[2]) <= MAX_SPLIT_FACTOR:
            return Placement("strided", int(m[1]), int(m[2]))
        raise ValueError(f"unknown placement {text[:60]!r}; use {PLACEMENT_FORMS}")

    def __str__(self) -> str:
        if self.kind == "replicate":
            return "Replicate()"
        if self.kind == "shard":
            return f"Shard({self.dim})"
        return f"_StridedShard({self.dim}, split_factor={self.split_factor})"


REPLICATE = Placement("replicate")


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape and the global trainer rank at each coordinate (row-major, flat)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    @cached_property
    def position(self) -> dict[int, int]:
        return {rank: i for i, rank in enumerate(self.ranks)}

    @staticmethod
    def from_json(shape: list[int], nested) -> "Mesh":
        """A mesh from its shape and nested rank list; ValueError if the list does not fill that shape with integers."""
        ranks = _flatten(nested, list(shape))
        if ranks is None:
            raise ValueError(f"ranks {nested} do not fill the mesh shape {list(shape)} with integers")
        return Mesh(tuple(shape), tuple(ranks))


def _flatten(nested, shape: list[int]) -> list[int] | None:
    if not shape:
        return [nested] if type(nested) is int else None
    if not isinstance(nested, list) or len(nested) != shape[0]:
        return None
    out: list[int] = []
    for item in nested:
        flat = _flatten(item, shape[1:])
        if flat is None:
            return None
        out += flat
    return out


@dataclass(frozen=True)
class Sharding:
    """How one tensor is laid out: a mesh and one placement per mesh dim."""

    mesh: Mesh
    placements: tuple[Placement, ...]

    def box(self, shape: tuple[int, ...], rank: int) -> Box | None:
        """The box of the global tensor `rank` holds; None if `rank` is not in the mesh."""
        position = self.mesh.position.get(rank)
        return None if position is None else mesh_boxes(self, tuple(shape))[position]


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's piece `index` of `size` split into `parts`, as [start, stop) (possibly empty)."""
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def _take(intervals: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions [start, stop) of the index list that `intervals` (global [a, b) ranges, in order) spell."""
    out, pos = [], 0
    for a, b in intervals:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _shard_indices(size: int, steps: list[tuple[Placement, int, int]]) -> list[tuple[int, int]]:
    """Global indices of one tensor dim a mesh coordinate holds, sharding left to right as DTensor does.

    `steps` are (placement, mesh dim size, coordinate) of the mesh dims that shard this tensor dim.
    _StridedShard(d, k) splits the current indices into k torch.chunk pieces, each piece into
    `n` chunks, and keeps chunk `c` of every piece (right-to-left sharding, e.g. FSDP over EP).
    """
    intervals = [(0, size)] if size else []
    for placement, n, c in steps:
        length = sum(b - a for a, b in intervals)
        if placement.kind == "shard":
            intervals = _take(intervals, *_chunk(length, n, c))
            continue
        kept: list[tuple[int, int]] = []
        for j in range(placement.split_factor):
            lo, hi = _chunk(length, placement.split_factor, j)
            a, b = _chunk(hi - lo, n, c)
            for start, stop in _take(intervals, lo + a, lo + b):
                if kept and kept[-1][1] == start:  # adjacent pieces form one range
                    kept[-1] = (kept[-1][0], stop)
                else:
                    kept.append((start, stop))
        intervals = kept
    return intervals


@lru_cache(maxsize=65536)
def mesh_boxes(sharding: Sharding, shape: tuple[int, ...]) -> tuple[Box, ...]:
    """The box held at every mesh position (flat, row-major); ValueError if one is not a box.

    An empty shard of dim d is (shape[d], shape[d]), the offset DTensor reports for it.
    """
    mesh, placements = sharding.mesh, sharding.placements
    if len(placements) != len(mesh.shape):
        raise ValueError(f"{len(placements)} placements for a {len(mesh.shape)}-D mesh")
    for p in placements:
        if p.kind != "replicate" and p.dim >= len(shape):
            raise ValueError(f"placement {p} on a {len(shape)}-D tensor")
    boxes = []
    for position in range(math.prod(mesh.shape)):
        coords, rest = [], position
        for n in reversed(mesh.shape):
            coords.append(rest % n)
            rest //= n
        coords.reverse()
        box = []
        for d, size in enumerate(shape):
            steps = [(p, mesh.shape[i], coords[i]) for i, p in enumerate(placements) if p.kind != "replicate" and p.dim == d]
            intervals = _shard_indices(size, steps)
            if len(intervals) > 1 and not math.prod(shape):  # no elements: only the shard's shape matters
                intervals = [(intervals[0][0], intervals[0][0] + sum(b - a for a, b in intervals))]
            if len(intervals) > 1:
                raise ValueError(
                    f"placements ({', '.join(map(str, placements))}) give the rank at mesh coordinate {tuple(coords)} "
                    f"a non-contiguous part of dim {d} (a _StridedShard not undone by a later Shard of that dim); "
                    "weightplan addresses shards that are boxes"
                )
            box.append(intervals[0] if intervals else (size, size))
        boxes.append(tuple(box))
    return tuple(boxes)
