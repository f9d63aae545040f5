"""The trainer's delta at publish: every page it serves diffed against the previous version, encoded into a registered region."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..delta.apply import delta_kernels
from ..delta.encode import UNIT_DTYPES, Encoding
from ..delta.path import delta_path
from ..delta.pages import Pages, delta_pages
from ..plan.format import Plan
from ..tables.quant import QuantTables
from ..transport.protocol import DeltaRecord
from ..transport.region_digests import byte_view

INDEX_WORDS = 3  # version, base (-1: no delta), page count; then the end of every page's blob in the delta region


@dataclass(frozen=True)
class DeltaStats:
    """One publish's delta on one trainer rank."""

    version: int
    base: int | None  # the version the delta applies to; None when this version has no delta
    changed_units: int  # units (wire elements of the page's unit) that differ from the previous version
    units: int  # every unit the pages hold
    delta_bytes: int  # the encoded delta (0 without one)
    page_bytes: int  # every byte the pages hold: what a full sync of them moves
    encodings: dict[str, int]  # pages per encoding
    seconds: float
    overflow: bool = False  # the delta did not fit the region: this version is served full only

    @property
    def density(self) -> float:
        return self.changed_units / self.units if self.units else 0.0


class SenderDelta:
    """Trainer `rank`'s delta pages (runtime/delta/pages.py), the previous version of their bytes and the region their
    delta is encoded into.

    Memory: `previous` is one copy of every page (the wire bytes receivers READ into destinations: about one copy of
    the rank's wire shard), `region` `fraction` of that, `index` 8 bytes per page. A version whose delta does not fit
    the region has none (receivers take it full); `previous` is updated either way.
    """

    def __init__(self, plan: Plan, rank: int, tables: QuantTables | None, ring_bytes: int, fraction: float,
                 spaces: list[torch.Tensor] = (), path: str = "auto"):
        if not 0 < fraction <= 1:
            raise ValueError(f"delta={fraction}: give the fraction of the served bytes the delta region holds, in (0, 1]")
        # host: numba kernels on host memory; device: the Triton kernels where the served spaces are (runtime/delta/path.py)
        self.path, device = delta_path(spaces, path, f"trainer rank {rank}")
        self.pages: Pages = delta_pages(plan, rank, tables, ring_bytes)
        size = int(self.pages.nbytes.sum())
        self._spaces = self.pages.spaces()
        # each space's previous pages back to back, every space starting 8-byte aligned (the kernel reads units)
        space_bytes = np.array([int(self.pages.nbytes[rows].sum()) for _, _, rows in self._spaces], dtype=np.int64)
        padded = (space_bytes + 7) // 8 * 8
        self._previous_at = np.cumsum(padded) - padded
        self.previous = torch.zeros(int(padded.sum()), dtype=torch.uint8, device=device)
        self._scratch = np.empty(max([int(self.pages.nbytes[rows].max() // self.pages.unit[rows[0]])
                                      for _, _, rows in self._spaces] or [1]), dtype=np.int64)
        self.region = torch.zeros(max(int(fraction * size), 64), dtype=torch.uint8, device=device)
        if self.path == "device":
            from ..delta.device import DeviceEncoder

            self._encoder = DeviceEncoder(self.pages, self._spaces, self._previous_at, device)
        self.index = torch.zeros(INDEX_WORDS + len(self.pages), dtype=torch.int64)
        self.base: int | None = None  # the version `previous` holds, None before the first publish or after a failed one
        self.stats: DeltaStats | None = None

    @property
    def registered(self) -> list[torch.Tensor]:
        return [self.region, self.index]

    @property
    def extra_bytes(self) -> int:
        """What keeping deltas costs this rank: the previous bytes, the delta region and the index."""
        return sum(t.numel() * t.element_size() for t in (self.previous, self.region, self.index))

    def info(self) -> dict:
        return {"index": [self.index.data_ptr(), self.index.numel() * 8], "region": [self.region.data_ptr(), self.region.numel()]}

    def publish(self, version: int, space: Callable[[int, int], torch.Tensor]) -> DeltaRecord:
        """Diff every page against the previous version, encode the delta of `version` and keep its bytes as the next
        base. `space(space, index)` gives the bytes of a page space as served now (a flat uint8 tensor)."""
        began = time.perf_counter()
        base, self.base = self.base, None
        if self.path == "device":
            encoded = self._encoder.encode(lambda i: space(*self._spaces[i][:2]), self.previous, self.region,
                                           self.region.numel(), base is not None)
            return self._published(version, base, encoded.used, encoded.fits, encoded.changed_units, encoded.ends,
                                   encoded.kinds, began)
        out, previous, capacity = byte_view(self.region), byte_view(self.previous), self.region.numel()
        ends = np.zeros(len(self.pages), dtype=np.int64)
        kinds = np.zeros(max(Encoding) + 1, dtype=np.int64)
        used, fits, changed_units = 0, base is not None, 0
        p = self.pages
        for (kind, index, rows), at in zip(self._spaces, self._previous_at.tolist()):
            unit = int(p.unit[rows[0]])
            served, dtype = byte_view(space(kind, index)), UNIT_DTYPES[unit]
            nbytes = int(p.nbytes[rows].sum())
            used, fits, k = delta_kernels().encode_pages(
                served[: len(served) // unit * unit].view(dtype), served, unit, previous[at : at + nbytes].view(dtype),
                p.start[rows] // unit, p.nbytes[rows] // unit, out, used, capacity, fits, ends, rows, self._scratch, kinds)
            changed_units += k
        return self._published(version, base, used, fits, changed_units, ends, kinds, began)

    def _published(self, version: int, base: int | None, used: int, fits: bool, changed_units: int, ends: np.ndarray,
                   kinds: np.ndarray, began: float) -> DeltaRecord:
        """The page index, stats and record of a publish's delta."""
        p = self.pages
        units = int((p.nbytes // p.unit).sum())
        kinds = {e.name.lower(): int(kinds[e]) for e in Encoding}
        self.index[:INDEX_WORDS] = torch.tensor([version, base if fits else -1, len(p)])
        self.index[INDEX_WORDS:] = torch.from_numpy(ends)
        self.base = version
        self.stats = DeltaStats(version, base if fits else None, changed_units, units, used if fits else 0,
                                int(p.nbytes.sum()), kinds, time.perf_counter() - began, base is not None and not fits)
        return DeltaRecord(base if fits else None, used if fits else 0, hashlib.sha256(byte_view(self.index)).hexdigest(),
                           self.stats.density)
