"""The inference rank's fp8 work: READs of fp8 values, scales and bf16 staging, and quantizing its own blocks per group."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..fp8.numerics import BLOCK, BlockQuantizer
from ..fp8.placement import Fp8Placement
from ..plan.columns import ColumnTable
from ..plan.format import Plan
from ..plan.schema import RECEIVER
from ..tables.quant import (QuantTables, exposed_regions, held_stages,
                           piece_segments, quant_sources, region_index, stage_packing)
from ..tables.ranks import Reads, RemoteRegion, contiguous_starts
from ..transport.region_digests import byte_view, digests

VALUES, SCALES, STAGED = 0, 1, 2  # what a READ row carries, for its digest key


@dataclass(frozen=True)
class QuantRows(ColumnTable):
    """One inference rank's fp8 READs from one trainer rank, one row per piece segment, scale range or stage copy,
    in canonical order (also the order both sides hash them in)."""

    region: np.ndarray  # exposed region index, or a RemoteRegion (FP8, SCALES, STAGE_PACKED)
    remote_off: np.ndarray
    buffer: np.ndarray  # destination entry (>= 0), or slot_buffer(k) for bf16 staging slot k
    local_off: np.ndarray  # bytes into that buffer
    nbytes: np.ndarray
    stage: np.ndarray
    kind: np.ndarray
    window: np.ndarray  # staging window of a stage copy, else -1


def slot_buffer(slot):
    """The buffer key of bf16 staging slot `slot` (an int or an array): negative, apart from destination entries."""
    return -1 - slot


def _empty_reads(dest: np.ndarray, nbytes: np.ndarray) -> Reads:
    zeros = np.zeros(len(dest), dtype=np.int64)
    return Reads(run=zeros, region=zeros, src_byte=zeros, dest=dest, dst_byte=zeros, nbytes=nbytes,
                 count=np.ones(len(dest), dtype=np.int64), src_stride=zeros, dst_stride=zeros)


class ReceiverQuant:
    """Inference `rank`'s part of a plan's quantization tables, writing into the flat destination views `dst`.

    Blocks a trainer quantizes (sender and gather sides) arrive as fp8 values and scales READ
    straight into the final parameters.
    Receiver-side blocks arrive as bf16 in two staging slots: the windows of pipeline group g go to
    slot g % 2, so staging is bounded by the two largest groups' windows (`staging_bytes`), and
    `quantize(g)` runs as group g's post-op while group g + 1 moves.

    The slots live on `placement.device`, the destinations' device: on a GPU the bf16 lands there and is quantized
    there (the Triton kernel on a GPU, the numba kernel on the host) unless `placement.kernel` is off.
    """

    def __init__(self, plan: Plan, rank: int, tables: QuantTables, dst: dict[int, torch.Tensor], placement: Fp8Placement):
        self.plan, self.rank, self.tables, self._dst = plan, rank, tables, dst
        self.device = placement.device
        self.held = held_stages(plan, rank)
        self.sources = quant_sources(plan, tables, rank)
        self.rows = {src: self._rows(src) for src in self.sources}
        p = tables.pieces
        self._pieces = np.flatnonzero((p.side == RECEIVER) & self.held[p.stage])
        self.slots: list[torch.Tensor] = []
        self._quantize = BlockQuantizer(plan.header.quant_layout.scale_rounding, use_kernel=placement.kernel)
        if self.quantizes:
            self._quantize.warm_up(self.device)
        self._dirty = False
        self.seconds = 0.0

    @property
    def quantizes(self) -> bool:
        """Whether this rank quantizes blocks itself (and so needs a post-op per group)."""
        return len(self._pieces) > 0

    @property
    def bytes(self) -> int:
        return int(sum(int(r.nbytes.sum()) for r in self.rows.values()))

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    def _rows(self, src: int) -> QuantRows:
        t, staging = self.tables, self.plan.staging
        p = t.pieces
        mine = t.pieces.take(np.flatnonzero((p.side != RECEIVER) & (p.src_rank == src) & self.held[p.stage]))
        piece, dest_off, in_piece, length = piece_segments(mine)
        weight = np.array([e.weight for e in staging], dtype=np.int64)
        scale = np.array([e.scale for e in staging], dtype=np.int64)
        c = t.copies
        copies = c.take(np.flatnonzero((c.side == RECEIVER) & (c.src_rank == src) & self.held[c.stage]))
        packed_at = stage_packing(self.plan, t, src).offsets_by_copy(len(c))[
            np.flatnonzero((c.side == RECEIVER) & (c.src_rank == src) & self.held[c.stage])]
        regions = region_index(exposed_regions(self.plan, t, src), copies)
        n_seg, n_pc, n_cp = len(piece), len(mine), len(copies)
        return QuantRows(
            region=np.concatenate([np.full(n_seg, RemoteRegion.FP8), np.full(n_pc, RemoteRegion.SCALES),
                                   np.where(packed_at >= 0, RemoteRegion.STAGE_PACKED, regions)]).astype(np.int64),
            remote_off=np.concatenate([mine.fp8_off[piece] + in_piece, mine.scale_off * 4,
                                       np.where(packed_at >= 0, packed_at, copies.src_off * 2)]).astype(np.int64),
            buffer=np.concatenate([weight[mine.stage[piece]], scale[mine.stage], np.full(n_cp, -1)]).astype(np.int64),
            local_off=np.concatenate([dest_off, mine.first_block * 4, copies.win_off * 2]).astype(np.int64),
            nbytes=np.concatenate([length, mine.n_blocks * 4, copies.length * 2]).astype(np.int64),
            stage=np.concatenate([mine.stage[piece], mine.stage, copies.stage]).astype(np.int64),
            kind=np.concatenate([np.full(n_seg, VALUES), np.full(n_pc, SCALES), np.full(n_cp, STAGED)]).astype(np.int64),
            window=np.concatenate([np.full(n_seg + n_pc, -1), copies.window]).astype(np.int64),
        )

    def grouping(self) -> dict:
        """Reads-shaped rows for rank_tables.pipeline_groups: every held stage counts under its fp8 weight entry."""
        weight = np.array([e.weight for e in self.plan.staging], dtype=np.int64)
        out = {("quant", src): _empty_reads(weight[r.stage], r.nbytes) for src, r in self.rows.items()}
        held = np.flatnonzero(self.held)
        out[("stages",)] = _empty_reads(weight[held], np.zeros(len(held), dtype=np.int64))
        return out

    def place(self, stage_group: np.ndarray, n_groups: int) -> None:
        """Lay group g's staging windows out in slot g % 2; prepare each group's quantization and zeroing views."""
        w = self.tables.windows
        windows = np.flatnonzero((w.side == RECEIVER) & self.held[w.stage])
        group = stage_group[w.stage[windows]]
        order = np.lexsort((windows, group))
        windows, group = windows[order], group[order]
        size = w.numel[windows]
        start = np.cumsum(size) - size
        first = np.searchsorted(group, group)  # first window of each window's group
        offset = start - start[first]
        self.slot_of = np.full(len(w), -1, dtype=np.int64)
        self.slot_off = np.full(len(w), -1, dtype=np.int64)
        self.slot_of[windows], self.slot_off[windows] = group % 2, offset
        used = np.zeros(n_groups, dtype=np.int64)
        np.add.at(used, group, size)
        self.slots = [torch.zeros(int(used[k::2].max(initial=0)), dtype=torch.bfloat16, device=self.device)
                      for k in range(min(2, n_groups))]
        for r in self.rows.values():
            staged = r.window >= 0
            r.buffer[staged] = slot_buffer(self.slot_of[r.window[staged]])
            r.local_off[staged] += self.slot_off[r.window[staged]] * 2
        self.stage_group = stage_group
        self._quant_views = [[] for _ in range(n_groups)]
        p = self.tables.pieces
        for i in self._pieces.tolist():
            win, entry = int(p.window[i]), self.plan.staging[int(p.stage[i])]
            h, wd, pitch = int(p.height[i]), int(p.width[i]), int(p.pitch[i])
            at = int(p.row[i] * pitch + p.col[i])
            x = self.slots[self.slot_of[win]][int(self.slot_off[win]) + at - int(w.lo[win]):].as_strided((h, wd), (pitch, 1))
            values = self._dst[entry.weight][at:].as_strided((h, wd), (pitch, 1))
            kr, kb = -(-h // BLOCK), -(-wd // BLOCK)
            scales = self._dst[entry.scale][int(p.first_block[i]) : int(p.first_block[i]) + kr * kb].view(kr, kb)
            self._quant_views[int(stage_group[p.stage[i]])].append((x, values, scales))
        uncovered = [[] for _ in range(n_groups)]
        for win, g in zip(windows.tolist(), group.tolist()):
            if not w.covered[win]:
                off = int(self.slot_off[win])
                uncovered[g].append(self.slots[g % 2][off : off + int(w.numel[win])])
        # After quantizing group g, its slot is next filled by group g + 2, or by group g % 2 of the next sync.
        self._zero_after = [uncovered[g + 2 if g + 2 < n_groups else g % 2] for g in range(n_groups)]

    def descriptors(self, src: int) -> tuple[np.ndarray, ...]:
        """(region, remote offset, local address, bytes, group) of the READs from `src`, merged where both sides are contiguous."""
        r = self.rows[src]
        group = self.stage_group[r.stage]
        bases = np.zeros(len(self.plan.dests) + 2, dtype=np.int64)  # the last two: slots 1 and 0 (buffers -2, -1)
        for b, t in [*self._dst.items(), *((slot_buffer(k), s) for k, s in enumerate(self.slots))]:
            bases[b] = t.data_ptr()
        local = bases[r.buffer] + r.local_off
        order = np.lexsort((r.remote_off, r.region, group))
        region, remote, local, n, g, buf = (a[order] for a in (r.region, r.remote_off, local, r.nbytes, group, r.buffer))
        first, merged = contiguous_starts(n, (remote, local), (region, buf, g))
        return region[first], remote[first], local[first], merged, g[first]

    def begin(self) -> bool:
        """Start a sync: staging left dirty by a failed one is zeroed (its padding must read as zeros); returns whether
        it was (on a GPU the caller then waits for the zeroing before READs land in the slots)."""
        zeroed = self._dirty
        if zeroed:
            for slot in self.slots:
                slot.zero_()
        self._dirty = True
        self.seconds = 0.0
        return zeroed

    def end(self) -> None:
        self._dirty = False

    def quantize(self, group: int) -> None:
        """Quantize the receiver-side blocks of `group` from staging into the fp8 weights and scales."""
        began = time.perf_counter()
        with torch.no_grad():
            for x, values, scales in self._quant_views[group]:
                self._quantize(x, values, scales)
            for view in self._zero_after[group]:
                view.zero_()
        self.seconds += time.perf_counter() - began

    def digests(self, src: int, group: int) -> dict[str, str]:
        """What landed from `src` for `group`, hashed as the sender hashed it (runtime/sender/quant.py)."""
        r = self.rows[src]
        rows = np.flatnonzero(self.stage_group[r.stage] == group)
        buffers = {b: byte_view(t) for b, t in self._dst.items()}
        buffers.update({slot_buffer(k): byte_view(s) for k, s in enumerate(self.slots)})
        return digests(buffers, r.buffer[rows], r.local_off[rows], r.nbytes[rows],
                       [self.key(k, s) for k, s in zip(r.kind[rows].tolist(), r.stage[rows].tolist())])

    def key(self, kind: int, stage: int) -> str:
        entry = self.plan.staging[stage]
        return str(entry.weight) if kind == VALUES else str(entry.scale) if kind == SCALES else f"s{stage}"

    def key_name(self, key: str) -> str:
        if key.startswith("s"):
            return f"{self.plan.staging[int(key[1:])].name} (bf16 staging)"
        return self.plan.dests[int(key)].name
