"""Trainer layouts: which rank holds which box of each trainer tensor (FSDP2 / EP / HSDP semantics).

Shared by the compiler (to split runs by shard) and the runtime (to check and address shards).

- Every non-expert tensor is sharded on dim 0 across the `fsdp` ranks of a replica with
  torch.chunk rules: chunks of ceil(d0 / fsdp) rows, the last ones smaller or empty.
- Expert stacks (`sharding == "expert"`, dim 0 = experts) are first split with torch.chunk over
  `ep` groups; rank j of a replica is in EP group j % ep (EP ranks are the fastest-varying mesh
  dim, as torchtitan builds its mesh). Each group's local stack is then sharded by the remaining
  fsdp // ep ranks (rank j has index j // ep among them) on dim 0 when (fsdp // ep) * ep does not
  exceed the number of experts, otherwise on dim 1.
- `replicas` (HSDP) repeats the layout: rank k * fsdp + j holds what rank j holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import PlanMismatchError


@dataclass(frozen=True)
class TrainerLayout:
    fsdp: int = 1
    ep: int = 1
    replicas: int = 1

    @staticmethod
    def parse(text: str) -> "TrainerLayout":
        """Parse `fsdp=N[,ep=M][,replicas=R]`."""
        values = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if key not in ("fsdp", "ep", "replicas") or not sep or not value.isdigit() or int(value) < 1:
                raise ValueError(f"bad trainer layout item {part!r} in {text!r}: expected fsdp=N[,ep=M][,replicas=R] with N, M, R >= 1")
            values[key] = int(value)
        layout = TrainerLayout(**values)
        if layout.fsdp % layout.ep:
            raise ValueError(f"trainer layout {text!r}: ep={layout.ep} must divide fsdp={layout.fsdp}")
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

    def as_dict(self) -> dict:
        return {"fsdp": self.fsdp, "ep": self.ep, "replicas": self.replicas}


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """torch.chunk's piece `index` of `size` split into `parts`: [start, stop), possibly empty."""
    step = math.ceil(size / parts) if size else 0
    start = min(index * step, size)
    return start, min(start + step, size)


def shard_box(layout: TrainerLayout, shape: tuple[int, ...], sharding: str, rank: int) -> tuple[tuple[int, int], ...]:
    """The [start, stop) range per dim of the global tensor that trainer `rank` holds."""
    if not 0 <= rank < layout.ranks:
        raise PlanMismatchError(f"trainer rank {rank} is outside the layout's {layout.ranks} ranks")
    box = [(0, n) for n in shape]
    if not shape:
        return tuple(box) if rank % layout.fsdp == 0 else ()
    j = rank % layout.fsdp
    if sharding != "expert" or layout.ep == 1:
        box[0] = _chunk(shape[0], layout.fsdp, j)
        return tuple(box)
    group, inner = j % layout.ep, j // layout.ep
    degree = layout.fsdp // layout.ep
    lo, hi = _chunk(shape[0], layout.ep, group)
    if degree * layout.ep <= shape[0] or len(shape) < 2:
        a, b = _chunk(hi - lo, degree, inner)
        box[0] = (lo + a, lo + b)
    else:
        box[0] = (lo, hi)
        box[1] = _chunk(shape[1], degree, inner)
    return tuple(box)


def local_shape(layout: TrainerLayout, shape: tuple[int, ...], sharding: str, rank: int) -> tuple[int, ...]:
    return tuple(b - a for a, b in shard_box(layout, shape, sharding, rank))


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
