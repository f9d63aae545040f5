"""Trainer layouts: the `fsdp/ep/replicas` shorthand as DTensor placements, and the canonical
explicit layout (`ShardLayout`: the box of every trainer tensor each rank holds) a plan carries.

Shared by the compiler (to bind layouts and split runs by shard) and the runtime (to address shards).
The shorthand follows FSDP2, EP and HSDP as torchtitan lays them out, on ranks
0 .. fsdp * replicas - 1 (rank k * fsdp + j is rank j of replica k):

- every non-expert tensor: mesh (replicas, fsdp), placements (Replicate(), Shard(0)); FSDP2
  chunks dim 0 with torch.chunk rules (the last chunks may be smaller or empty);
- expert stacks (`sharding == "expert"`, dim 0 = experts) with ep > 1: rank j of a replica is in
  EP group j % ep (EP is the fastest-varying mesh dim) with index j // ep among the group's
  fsdp // ep ranks. EP chunks the experts, then FSDP chunks each group's stack on dim 0, or on
  dim 1 when (fsdp // ep) * ep exceeds the number of experts. As placements that is mesh
  (replicas, ep, fsdp // ep) holding rank k * fsdp + c * ep + g at (k, g, c), with
  (Replicate(), Shard(0), Shard(0)) or (Replicate(), Shard(0), Shard(1)). FSDP2 itself reports
  the dim-0 case as (_StridedShard(0, split_factor=ep), Shard(0)) on mesh (fsdp // ep, ep), which
  gives the same boxes whenever ep divides the experts.

A plan stores layouts as boxes, not placements, so every description of the same shards (the
shorthand, or the file a DTensor trainer writes) gives the same plan.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from ..errors import PlanMismatchError
from .placements import REPLICATE, Box, Mesh, Placement, Sharding, mesh_boxes

RankBoxes = tuple[Box | None, ...]  # the box each trainer rank holds; None: not in the tensor's mesh


MAX_RANKS = 4096  # ranks on either side of a plan: far beyond today's clusters, small enough to trace


def layout_items(text: str, option: str, form: str, numbers: tuple[str, ...], flags: tuple[str, ...] = ()) -> dict:
    """`key=N` items (and bare `flag`s) of a layout string; ValueError naming the option and item for anything else.

    Refused: an empty string, unknown or repeated keys, numbers that are not ASCII digits or lie outside 1..MAX_RANKS.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{option} is empty: expected {form}")
    values: dict = {}
    for part in (p.strip() for p in text.split(",")):
        key, sep, value = part.partition("=")
        if key in values:
            raise ValueError(f"{option} {text!r} gives {key} twice")
        if key in flags and not sep:
            values[key] = True
        elif key in numbers and sep and value.isascii() and value.isdigit() and 1 <= int(value) <= MAX_RANKS:
            values[key] = int(value)
        else:
            raise ValueError(f"bad {option} item {part!r} in {text!r}: expected {form} with numbers 1..{MAX_RANKS}")
    return values


@dataclass(frozen=True)
class TrainerLayout:
    """The `--trainer fsdp=N[,ep=M][,replicas=R]` shorthand."""

    fsdp: int = 1
    ep: int = 1
    replicas: int = 1

    @staticmethod
    def parse(text: str) -> "TrainerLayout":
        """Parse `fsdp=N[,ep=M][,replicas=R]`."""
        layout = TrainerLayout(**layout_items(text, "--trainer", "fsdp=N[,ep=M][,replicas=R]", ("fsdp", "ep", "replicas")))
        if layout.fsdp % layout.ep:
            raise ValueError(f"trainer layout {text!r}: ep={layout.ep} must divide fsdp={layout.fsdp}")
        if layout.ranks > MAX_RANKS:
            raise ValueError(f"trainer layout {text!r} has {layout.ranks} ranks; plans support at most {MAX_RANKS} per side")
        return layout

    @property
    def ranks(self) -> int:
        return self.fsdp * self.replicas

    @property
    def token(self) -> str:
        parts = [f"fsdp{self.fsdp}"]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.replicas > 1:
            parts.append(f"r{self.replicas}")
        return "-".join(parts)

    def sharding_for(self, shape: tuple[int, ...], sharding: str) -> Sharding:
        """The mesh and placements of a tensor of this shape and kind ("dense" or "expert")."""
        return _expand(self, tuple(shape), sharding)

    def bind(self, specs) -> "ShardLayout":
        """The explicit layout of these trainer tensors (objects with name, shape and sharding kind)."""
        return ShardLayout.build(specs, [self.sharding_for(s.shape, s.sharding) for s in specs])


@lru_cache(maxsize=4096)
def _expand(layout: TrainerLayout, shape: tuple[int, ...], kind: str) -> Sharding:
    shard0 = Placement("shard", 0) if shape else REPLICATE
    ranks = np.arange(layout.ranks)
    if kind != "expert" or layout.ep == 1:
        return Sharding(Mesh((layout.replicas, layout.fsdp), tuple(ranks.tolist())), (REPLICATE, shard0))
    degree = layout.fsdp // layout.ep
    inner = Placement("shard", 1) if degree * layout.ep > shape[0] and len(shape) >= 2 else shard0
    grid = ranks.reshape(layout.replicas, degree, layout.ep).transpose(0, 2, 1)
    return Sharding(Mesh(grid.shape, tuple(grid.reshape(-1).tolist())), (REPLICATE, shard0, inner))


def shard_box(layout: TrainerLayout, shape: tuple[int, ...], sharding: str, rank: int) -> Box:
    """The [start, stop) range per dim of the global tensor that trainer `rank` holds under a shorthand."""
    if not 0 <= rank < layout.ranks:
        raise PlanMismatchError(f"trainer rank {rank} is outside the layout's {layout.ranks} ranks")
    return layout.sharding_for(shape, sharding).box(shape, rank)


@lru_cache(maxsize=65536)
def rank_boxes(sharding: Sharding, shape: tuple[int, ...], world: int) -> RankBoxes:
    """The box each of `world` trainer ranks holds of a tensor with this sharding."""
    boxes: list[Box | None] = [None] * world
    for rank, box in zip(sharding.mesh.ranks, mesh_boxes(sharding, shape)):
        boxes[rank] = box
    return tuple(boxes)


@dataclass(frozen=True)
class ShardLayout:
    """The explicit layout a plan carries: per trainer tensor (in trainer order) the box each rank holds.

    `classes` holds each distinct per-rank box table once; `of[i]` is tensor i's class. `token`
    names the layout: the shorthand (smallest ep) with the same boxes, else `layout-<hash>`.
    """

    token: str
    names: tuple[str, ...]
    classes: tuple[RankBoxes, ...]
    of: tuple[int, ...]

    @staticmethod
    def build(specs, shardings) -> "ShardLayout":
        """From trainer tensors (name, shape, sharding kind) and their Shardings; ValueError if a shard is no box."""
        world = 1 + max((max(s.mesh.ranks) for s in shardings), default=0)
        classes: dict[RankBoxes, int] = {}
        of = tuple(classes.setdefault(rank_boxes(s, tuple(spec.shape), world), len(classes)) for spec, s in zip(specs, shardings))
        table = tuple(classes)
        return ShardLayout(_token(specs, table, of, world), tuple(s.name for s in specs), table, of)

    @property
    def ranks(self) -> int:
        """Number of trainer ranks."""
        return len(self.classes[0]) if self.classes else 1

    def box(self, index: int, rank: int) -> Box | None:
        return self.classes[self.of[index]][rank]

    @cached_property
    def _index(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.names)}

    def index(self, name: str) -> int:
        return self._index[name]

    def as_dict(self) -> dict:
        """The header's `trainer.boxes` table: per class, per rank, [[start, stop], ...] or null."""
        return {"boxes": [[None if b is None else [list(r) for r in b] for b in boxes] for boxes in self.classes]}

    @staticmethod
    def from_header(trainer, sources: list[tuple[str, int]]) -> "ShardLayout":
        """Rebuild from a plan header: its `trainer` record (token and boxes) and (name, class) per source."""
        return ShardLayout(trainer.token, tuple(n for n, _ in sources), trainer.boxes, tuple(c for _, c in sources))

    def bind(self, specs) -> "ShardLayout":
        if tuple(s.name for s in specs) != self.names:
            raise ValueError("this trainer layout describes other trainer tensors")
        return self


def shorthands(ranks: int) -> Iterator[TrainerLayout]:
    """Every `fsdp/ep/replicas` shorthand over `ranks` ranks, fewest replicas then smallest ep first (the naming order)."""
    for replicas in _divisors(ranks):
        for ep in _divisors(ranks // replicas):
            yield TrainerLayout(ranks // replicas, ep, replicas)


def _token(specs, classes: tuple[RankBoxes, ...], of: tuple[int, ...], world: int) -> str:
    for candidate in shorthands(world):
        if all(rank_boxes(candidate.sharding_for(s.shape, s.sharding), tuple(s.shape), world) == classes[c]
               for s, c in zip(specs, of)):
            return candidate.token
    tables = ShardLayout("", (), classes, of).as_dict()["boxes"], list(of)
    return "layout-" + hashlib.sha256(json.dumps(tables).encode()).hexdigest()[:12]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def box_segments(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A box of a row-major tensor as contiguous flat segments: (global start, length, local start)."""
    empty = np.zeros(0, dtype=np.int64)
    if not shape:
        return (np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)) if box == () else (empty,) * 3
    sizes = [b - a for a, b in box]
    if 0 in sizes:
        return (empty,) * 3
    # The innermost dims the box covers fully, plus the first partial one, form one segment.
    d = len(shape) - 1
    while d > 0 and sizes[d] == shape[d]:
        d -= 1
    inner = math.prod(shape[d + 1 :])
    seg_len = sizes[d] * inner
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    starts = np.array([box[d][0] * strides[d]], dtype=np.int64)
    for i in range(d - 1, -1, -1):
        starts = (np.arange(box[i][0], box[i][1], dtype=np.int64)[:, None] * strides[i] + starts[None, :]).reshape(-1)
    local = np.arange(len(starts), dtype=np.int64) * seg_len
    return starts, np.full(len(starts), seg_len, dtype=np.int64), local
