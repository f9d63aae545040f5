"""The pages a trainer rank diffs at every publish and the destination each page's bytes land in: pure functions of a plan.

A delta is computed over *spaces*: the byte areas a trainer rank serves that receivers READ into their destinations.
They are its exposed regions (only the pages its in-place runs touch), its packed region (each ring chunk a space of
its own), and with fp8 tables its fp8 values and scales. Receiver-side fp8 stage copies land in the receiver's
staging slots, not in a destination: they are never part of a delta and are always read whole. Each space is cut
into pages of PAGE_BYTES; sender and receivers derive the same pages from the plan alone, and the receiver maps a
changed unit of a page to the destination bytes its READ descriptors would have written it to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from ..plan.columns import ColumnTable
from ..plan.format import Plan
from ..plan.schema import DTYPE_SIZES
from ..tables.quant import QuantTables, exposed_regions
from ..tables.ranks import RemoteRegion, packing_of, served_runs
from ..tables.ring import ring_chunks

PAGE_BYTES = 64 << 10  # 32768 bf16 units: page positions fit uint16 indices


class Space(enum.IntEnum):
    """The kind of area a page belongs to (with `index`: the region, or the ring chunk)."""

    REGION = 0
    PACKED = 1
    FP8 = 2
    SCALES = 3


@dataclass(frozen=True)
class Pages(ColumnTable):
    """A trainer rank's delta pages in publish order: (space, index) ascending, then start."""

    space: np.ndarray
    index: np.ndarray
    start: np.ndarray  # byte offset in the space
    nbytes: np.ndarray
    unit: np.ndarray  # bytes per diffed unit: the wire element size (the smallest of a packed chunk's)

    def spaces(self) -> list[tuple[int, int, np.ndarray]]:
        """(space, index, rows) of every space, in publish order."""
        key = self.space * (1 << 32) + self.index
        cuts = np.flatnonzero(np.diff(key)) + 1
        return [(int(self.space[r[0]]), int(self.index[r[0]]), r) for r in np.split(np.arange(len(self)), cuts) if len(r)]


def _cover(lo: np.ndarray, hi: np.ndarray, size: int, unit: int, space: Space, index: int) -> Pages:
    """The pages of a space of `size` bytes that the byte ranges [lo, hi) touch."""
    first, last = lo // PAGE_BYTES, (hi - 1) // PAGE_BYTES
    n = np.maximum(last - first + 1, 0)
    page = np.unique(np.repeat(first, n) + np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n))
    start = page * PAGE_BYTES
    k = len(page)
    return Pages(np.full(k, int(space)), np.full(k, index), start, np.minimum(start + PAGE_BYTES, size) - start,
                 np.full(k, unit))


def delta_pages(plan: Plan, rank: int, tables: QuantTables | None, ring_bytes: int) -> Pages:
    """Every page trainer `rank` of `plan` (as it serves it: `plan.pulling` with fan-out) diffs at publish."""
    regions = exposed_regions(plan, tables, rank)
    served = served_runs(plan, rank)
    packing = packing_of(served)
    parts = []
    in_place = served.take(np.flatnonzero(packing.offsets_of(served.run) < 0))
    extent = in_place.src_byte + (in_place.count - 1) * in_place.src_stride + in_place.nbytes
    for i, region in enumerate(regions):
        mine = in_place.region == i
        if mine.any():
            parts.append(_cover(in_place.src_byte[mine], extent[mine], region.nbytes, DTYPE_SIZES[region.wire_dtype],
                                Space.REGION, i))
    if packing.nbytes:
        packed = np.isin(served.run, packing.run)
        unit = min(DTYPE_SIZES[regions[r].wire_dtype] for r in set(served.region[packed].tolist()))
        ring = ring_chunks(packing, ring_bytes)
        sizes = [packing.nbytes] if ring is None else np.diff(ring.start).tolist()
        for c, size in enumerate(sizes):
            parts.append(_cover(np.zeros(1, dtype=np.int64), np.full(1, size), size, unit, Space.PACKED, c))
    if tables is not None:
        fp8, scales = tables.region_bytes(rank)
        for space, size, unit in ((Space.FP8, fp8, 1), (Space.SCALES, 4 * scales, 4)):
            if size:
                parts.append(_cover(np.zeros(1, dtype=np.int64), np.full(1, size), size, unit, space, 0))
    return Pages.concat(parts)


def space_of(region: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(space, index) of READ descriptors by their remote region (exposed index or RemoteRegion) and ring chunk;
    space -1 for the receiver-side stage copies packed by the trainer, which are never in a delta."""
    space = np.select([region >= 0, region == RemoteRegion.PACKED, region == RemoteRegion.FP8,
                       region == RemoteRegion.SCALES], [int(Space.REGION), int(Space.PACKED), int(Space.FP8),
                                                        int(Space.SCALES)], -1)
    index = np.where(region >= 0, region, np.where(region == RemoteRegion.PACKED, np.maximum(chunk, 0), 0))
    return space, index


@dataclass(frozen=True)
class Targets(ColumnTable):
    """Where a receiver's delta-able READ descriptors from one trainer rank put the bytes of its pages: the
    descriptor's remote bytes [start, start + nbytes) of page space (space, index) land in destination `entry` at
    `dst_byte`. Sorted by (space, index, start)."""

    space: np.ndarray
    index: np.ndarray
    start: np.ndarray
    nbytes: np.ndarray
    entry: np.ndarray
    dst_byte: np.ndarray


def targets(region: np.ndarray, remote_off: np.ndarray, nbytes: np.ndarray, local: np.ndarray, chunk: np.ndarray,
            bases: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, Targets]:
    """Which READ descriptors (columns of runtime/tables/receiver.py Descriptors) a delta can replace (those writing
    into destination entries at `bases` of `sizes` bytes, by entry; -1 for entries not held), and their Targets."""
    space, index = space_of(region, chunk)
    held = np.flatnonzero(bases >= 0)
    order = held[np.argsort(bases[held])]
    at = np.searchsorted(bases[order], local, side="right") - 1
    entry = order[np.maximum(at, 0)] if len(order) else np.zeros(len(local), dtype=np.int64)
    inside = (at >= 0) & (local + nbytes <= bases[entry] + sizes[entry]) if len(order) else np.zeros(len(local), bool)
    deltable = inside & (space >= 0)
    rows = np.flatnonzero(deltable)
    rows = rows[np.lexsort((remote_off[rows], index[rows], space[rows]))]
    return deltable, Targets(space[rows], index[rows], remote_off[rows], nbytes[rows], entry[rows],
                             local[rows] - bases[entry[rows]])


def needed_pages(pages: Pages, found: Targets) -> np.ndarray:
    """Boolean mask over `pages`: the pages some target overlaps (what a receiver reads the delta of)."""
    need = np.zeros(len(pages), dtype=bool)
    for space, index, rows in pages.spaces():
        mine = (found.space == space) & (found.index == index)
        if not mine.any():
            continue
        lo, hi = found.start[mine], found.start[mine] + found.nbytes[mine]
        start, end = pages.start[rows], pages.start[rows] + pages.nbytes[rows]
        # a page is needed when some target starts before its end and ends after its start
        order = np.argsort(lo)
        lo, hi = lo[order], np.maximum.accumulate(hi[order])
        k = np.searchsorted(lo, end, side="left") - 1  # last target starting before the page's end
        need[rows] = (k >= 0) & (hi[np.maximum(k, 0)] > start)
    return need
