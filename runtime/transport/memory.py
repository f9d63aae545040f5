"""Where registered memory lives: a tensor's NIXL memory type and device, and descriptor rows grouped by them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SyncError, WeightplanError

DRAM, VRAM = "DRAM", "VRAM"
MAX_DEVICE = 1 << 16  # a device id beyond this in a peer's record is malformed, not a GPU
MAX_SPANS = 1 << 22  # a published memory record longer than this is refused (a plan has far fewer regions)
# Every area a peer publishes ends below this: descriptor tables hold its addresses, and sums of them, as int64.
ADDRESS_LIMIT = 1 << 63


def check_area(address, nbytes, field: str, who: str) -> tuple[int, int]:
    """(address, nbytes) of `who`'s info field `field`, once both are integers and the area ends below ADDRESS_LIMIT;
    a SyncError naming `who` and the field otherwise (never an overflow or a wrapped address later)."""
    integers = all(isinstance(v, int) and not isinstance(v, bool) for v in (address, nbytes))
    if not integers or not (0 <= address and 0 <= nbytes and address + nbytes < ADDRESS_LIMIT):
        area = f"[{address:#x}, +{nbytes})" if integers else f"[{str(address)[:24]}, +{str(nbytes)[:24]})"
        raise SyncError(f"{who}: its info's {field!r} is {area[:80]}, not an area below 2**63")
    return address, nbytes


def holding(starts: np.ndarray, ends: np.ndarray, address, nbytes) -> np.ndarray:
    """The index of the interval of sorted, disjoint [starts, ends) that holds each (address, nbytes) row whole, -1
    where none does; compared without wrap-around, so a row whose end passes 2**64 is held by none."""
    address, nbytes = np.asarray(address, dtype=np.uint64), np.asarray(nbytes, dtype=np.uint64)
    at = np.searchsorted(starts, address, side="right").astype(np.int64) - 1
    ok = at >= 0
    end = ends[at[ok]]
    ok[ok] = (address[ok] <= end) & (nbytes[ok] <= end - np.minimum(address[ok], end))
    return np.where(ok, at, -1)


@dataclass(frozen=True, order=True)
class Placement:
    """A NIXL memory segment: host memory (`DRAM`, device 0) or the memory of CUDA device `device` (`VRAM`)."""

    kind: str
    device: int = 0

    def __str__(self) -> str:
        return "host" if self.kind == DRAM else f"cuda:{self.device}"


HOST = Placement(DRAM, 0)


def placement_of(tensor: torch.Tensor) -> Placement:
    """The NIXL segment of a tensor's memory: DRAM for host tensors (pinned or not: NIXL registers both), VRAM with the
    device index for CUDA tensors; anything else (meta, another accelerator) is refused in one line."""
    device = tensor.device
    if device.type == "cpu":
        return HOST
    if device.type == "cuda":
        return Placement(VRAM, torch.cuda.current_device() if device.index is None else device.index)
    raise WeightplanError(f"a tensor on {device} cannot be registered with NIXL: weightplan moves host and CUDA memory only")


@dataclass(frozen=True)
class Span:
    """One registered tensor's bytes: [address, address + nbytes) in `placement`."""

    address: int
    nbytes: int
    placement: Placement

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Span":
        if not tensor.is_contiguous():
            raise WeightplanError(f"a non-contiguous tensor {tuple(tensor.shape)} cannot be registered with NIXL")
        return cls(tensor.data_ptr(), tensor.numel() * tensor.element_size(), placement_of(tensor))


def group_spans(spans: list[Span]) -> dict[Placement, list[Span]]:
    """Spans by placement, in first-seen order (one NIXL registration per placement: a list holds one memory type)."""
    out: dict[Placement, list[Span]] = {}
    for span in spans:
        out.setdefault(span.placement, []).append(span)
    return out


@dataclass(frozen=True)
class MemoryMap:
    """Registered memory of one agent (this process's, or a peer's as it published it): sorted, non-overlapping
    intervals, each in one placement. It says which placement each descriptor row lies in."""

    starts: np.ndarray  # uint64, sorted
    ends: np.ndarray  # uint64, exclusive
    where: np.ndarray  # int64 index into `placements`
    placements: tuple[Placement, ...]

    @classmethod
    def of(cls, spans: list[Span]) -> "MemoryMap":
        """Spans merged where they overlap within one placement (views of one buffer registered apart). Spans that only
        touch stay apart: a descriptor must lie inside one registration, as NIXL requires."""
        placements = tuple(sorted({s.placement for s in spans}))
        merged: list[list] = []
        for s in sorted(spans, key=lambda s: (s.address, s.address + s.nbytes)):
            if not s.nbytes:
                continue
            last = merged[-1] if merged else None
            if last is not None and s.address < last[1] and last[2] == s.placement:
                last[1] = max(last[1], s.address + s.nbytes)
            elif last is not None and s.address < last[1]:
                raise WeightplanError(f"memory at {s.address:#x} is registered both in {last[2]} and in {s.placement}")
            else:
                merged.append([s.address, s.address + s.nbytes, s.placement])
        index = {p: i for i, p in enumerate(placements)}
        return cls(np.array([m[0] for m in merged], dtype=np.uint64), np.array([m[1] for m in merged], dtype=np.uint64),
                   np.array([index[m[2]] for m in merged], dtype=np.int64), placements)

    def spans(self) -> list[Span]:
        return [Span(int(a), int(e - a), self.placements[w]) for a, e, w in zip(self.starts, self.ends, self.where)]

    def record(self) -> list[list]:
        """The JSON a process publishes in its info ('memory'): [address, bytes, "DRAM"|"VRAM", device] per span."""
        return [[s.address, s.nbytes, s.placement.kind, s.placement.device] for s in self.spans()]

    @classmethod
    def from_record(cls, value, who: str) -> "MemoryMap":
        """A peer's published 'memory' field, or a SyncError naming `who` and what is malformed."""
        if not isinstance(value, list) or len(value) > MAX_SPANS:
            raise SyncError(f"{who}: its info's 'memory' is not a list of [address, bytes, memory type, device]")
        spans = []
        for row in value:
            if not (isinstance(row, list) and len(row) == 4 and row[2] in (DRAM, VRAM)
                    and isinstance(row[3], int) and not isinstance(row[3], bool) and 0 <= row[3] < MAX_DEVICE
                    and (row[2] == VRAM or row[3] == 0)):
                raise SyncError(f"{who}: its info's 'memory' holds {str(row)[:60]}, expected [address, bytes, "
                                "'DRAM' or 'VRAM', device]")
            spans.append(Span(*check_area(row[0], row[1], "memory", who), Placement(row[2], row[3])))
        try:
            return cls.of(spans)
        except WeightplanError as exc:
            raise SyncError(f"{who}: its info's 'memory' is inconsistent: {exc}") from None

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """The index into `placements` of each (address, bytes) row, -1 where no single span holds the whole row."""
        rows = np.asarray(rows, dtype=np.uint64).reshape(-1, 2)
        at = holding(self.starts, self.ends, rows[:, 0], rows[:, 1])
        out = np.full(len(rows), -1, dtype=np.int64)
        out[at >= 0] = self.where[at[at >= 0]]
        return out


EMPTY = MemoryMap.of([])


@dataclass(frozen=True)
class RowGroups:
    """Descriptor rows split by placement: NIXL prepares one list per memory type, so a list spanning host and device
    memory is several NIXL lists; `group[i]` and `index[i]` say which one holds row i and where in it."""

    placements: tuple[Placement, ...]
    members: tuple[np.ndarray, ...]  # row indices of each group, ascending
    group: np.ndarray  # int64 per row
    index: np.ndarray  # int64 per row: its position in its group


def group_rows(memory: MemoryMap, rows: np.ndarray) -> RowGroups:
    """Split (address, bytes) rows by the placement `memory` gives each; raises ValueError naming the first row no span holds."""
    rows = np.asarray(rows).reshape(-1, 2)
    where = memory.locate(rows)
    if (where < 0).any():
        first = int(np.flatnonzero(where < 0)[0])
        raise ValueError(f"[{int(rows[first, 0]):#x}, +{int(rows[first, 1])}) lies in no registered memory")
    used = np.unique(where)
    group = np.searchsorted(used, where).astype(np.int64)
    members = tuple(np.flatnonzero(group == g) for g in range(len(used)))
    index = np.empty(len(rows), dtype=np.int64)
    for m in members:
        index[m] = np.arange(len(m))
    return RowGroups(tuple(memory.placements[i] for i in used.tolist()), members, group, index)
