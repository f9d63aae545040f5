"""The trainer's fp8 work at publish: its own and gathered bf16 into an arena, its blocks quantized into registered fp8 + scale regions."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..casts import cast_along
from ..fp8.numerics import BLOCK, BlockQuantizer
from ..fp8.placement import Fp8Placement
from ..plan.format import Plan
from ..plan.schema import RECEIVER
from ..tables.quant import QuantTables, region_index, served_copies, stage_packing
from ..tables.ranks import ServedRegion
from ..transport.region_digests import byte_view, digests
from .gather import Gather, index_ranges

# Stage copies shorter than this (elements) are gathered with one index_copy_ per source: a Python
# slice copy per run costs microseconds, which thousands of per-row runs (TP column slices) add up.
SMALL_COPY = 4096
GATHERED = -1  # source key of the buffer holding the bf16 read from peer trainer ranks (runtime/sender/trainer_gather.py)
BF16 = ("bfloat16",)


class SenderQuant:
    """Trainer `rank`'s part of a plan's quantization tables.

    At every publish it packs the small receiver-side stage copies (bf16, read from the exposed
    regions) and, window by window, copies its sender- and gather-side stage runs from its own
    shards or from `gathered` (copy i of tables.gathered(rank) at element gathered_at[i]) into one
    reused bf16 arena (or uses the source in place when a window is one uncast run) and quantizes
    its pieces into `fp8` and `scales`: each piece's values row-major, so a piece of whole block
    rows is one contiguous READ for the receivers, and its scales contiguous.

    Everything it allocates (fp8, scales, packed stage copies, arena, gather indexes) lives on `placement.device`,
    the device of the trainer's tensors: on a GPU the whole publish runs there in torch ops and receivers READ it
    GPU to GPU. Whole tiles quantize in the device's kernel (numba on the host, Triton on a GPU) unless `placement.kernel`
    is off (runtime/fp8/placement.py).
    """

    def __init__(self, plan: Plan, rank: int, tables: QuantTables, regions: tuple[ServedRegion, ...],
                 exposed: list[torch.Tensor], sources: dict[int, torch.Tensor], placement: Fp8Placement,
                 gathered: torch.Tensor | None = None, gathered_at: np.ndarray | None = None):
        self.plan, self.rank, self.tables = plan, rank, tables
        self.device = device = placement.device
        c = tables.copies
        # Where each copy's bf16 is read from: its source shard, or the gather buffer (already in bf16).
        self._src, self._src_off, self._chain = c.src.copy(), c.src_off.copy(), c.wire.copy()
        remote = tables.gathered(rank)
        self._src[remote], self._chain[remote] = GATHERED, -1
        if len(remote):
            self._src_off[remote] = gathered_at
            sources = {**sources, GATHERED: gathered}
        self.pieces = tables.sender_pieces(rank)
        fp8_bytes, n_scales = tables.region_bytes(rank)
        self.fp8 = torch.zeros(fp8_bytes, dtype=torch.uint8, device=device)
        self.scales = torch.zeros(n_scales, dtype=torch.float32, device=device)
        self.packing = stage_packing(plan, tables, rank)
        self.stage_packed = torch.empty(self.packing.nbytes, dtype=torch.uint8, device=device)
        packed = tables.copies.take(self.packing.copy)
        self._pack = Gather(exposed, self.stage_packed, region_index(regions, packed), packed.src_off * 2,
                            packed.length * 2, self.packing.packed_byte, self.packing.unit)
        self._quantize = BlockQuantizer(plan.header.quant_layout.scale_rounding, use_kernel=placement.kernel)
        self._windows = self._plan_windows(sources)
        if self._windows:
            self._quantize.warm_up(self.device)
        self._digest_rows = self._digest_table(regions, len(exposed))
        self.seconds = 0.0

    @property
    def registered(self) -> list[torch.Tensor]:
        return [self.fp8, self.scales, self.stage_packed]

    def info(self) -> dict:
        """Addresses and sizes the receivers check and read from."""
        return {name: [t.data_ptr(), t.numel() * t.element_size()]
                for name, t in (("fp8", self.fp8), ("scales", self.scales), ("stage_packed", self.stage_packed))}

    def _plan_windows(self, sources: dict[int, torch.Tensor]) -> list:
        """Per window: (zero the arena first?, slice copies, gathers, [(input, values, scales) views per piece])."""
        w, c = self.tables.windows, self.tables.copies
        mine = np.flatnonzero((w.side != RECEIVER) & (w.src_rank == self.rank))
        copies = np.flatnonzero((c.side != RECEIVER) & (c.quant_rank == self.rank))
        self.arena = torch.empty(int(w.numel[mine].max(initial=0)), dtype=torch.bfloat16, device=self.device)
        fp8 = self.fp8.view(torch.float8_e4m3fn)
        p = self.pieces
        copies = copies[np.argsort(c.window[copies], kind="stable")]
        copy_at = np.searchsorted(c.window[copies], [mine, mine + 1])
        by_window = np.argsort(p.window, kind="stable")
        piece_at = np.searchsorted(p.window[by_window], [mine, mine + 1])
        steps = []
        for j, window in enumerate(mine.tolist()):
            rows = copies[copy_at[0][j] : copy_at[1][j]]
            in_place = (len(rows) == 1 and len(self._cast_chain(rows[0])) == 1 and c.win_off[rows[0]] == 0
                        and c.length[rows[0]] == w.numel[window])
            if in_place:  # the shard (or gather buffer) already holds the window's bf16 elements in order
                base, shift, slices, gathers = sources[int(self._src[rows[0]])], int(self._src_off[rows[0]]), [], []
            else:
                base, shift = self.arena, 0
                slices, gathers = self._fills(sources, rows)
            views = []
            for i in by_window[piece_at[0][j] : piece_at[1][j]].tolist():
                h, wd, pitch = int(p.height[i]), int(p.width[i]), int(p.pitch[i])
                start = shift + int(p.row[i] * pitch + p.col[i] - w.lo[window])
                x = base[start:].as_strided((h, wd), (pitch, 1))
                values = fp8[int(p.fp8_off[i]) : int(p.fp8_off[i]) + h * wd].view(h, wd)
                kr, kb = -(-h // BLOCK), -(-wd // BLOCK)
                scales = self.scales[int(p.scale_off[i]) : int(p.scale_off[i]) + kr * kb].view(kr, kb)
                views.append((x, values, scales))
            zero = None if in_place or w.covered[window] else self.arena[: int(w.numel[window])]
            steps.append((zero, slices, gathers, views))
        return steps

    def _cast_chain(self, copy: int) -> tuple[str, ...]:
        return BF16 if self._chain[copy] < 0 else self.plan.cast_chains[int(self._chain[copy])]

    def _fills(self, sources: dict[int, torch.Tensor], rows: np.ndarray):
        c, key, off_of, chain_of = self.tables.copies, self._src, self._src_off, self._chain
        big = rows[c.length[rows] >= SMALL_COPY]
        slices = []
        for i in big.tolist():
            src, off, n, at = sources[int(key[i])], int(off_of[i]), int(c.length[i]), int(c.win_off[i])
            slices.append((self.arena[at : at + n], src[off : off + n], self._cast_chain(i)))
        small = rows[c.length[rows] < SMALL_COPY]
        gathers = []
        for src, chain in sorted(set(zip(key[small].tolist(), chain_of[small].tolist()))):
            sel = small[(key[small] == src) & (chain_of[small] == chain)]
            gathers.append((sources[src], self._cast_chain(sel[0]),
                            torch.from_numpy(index_ranges(off_of[sel], c.length[sel])).to(sources[src].device),
                            torch.from_numpy(index_ranges(c.win_off[sel], c.length[sel])).to(self.device)))
        return slices, gathers

    def publish(self, progress=None) -> float:
        """Pack the receiver-side stage copies and quantize this rank's blocks; returns the seconds spent.

        `progress()`, if given, runs after every window: peers gathering from this rank READ while it
        quantizes, and without a NIXL progress thread their READs advance only when this rank polls.
        """
        began = time.perf_counter()
        with torch.no_grad():
            self._pack()
            for zero, slices, gathers, views in self._windows:
                if progress is not None:
                    progress()
                if zero is not None:
                    zero.zero_()  # unwritten elements are vLLM's zero padding
                for dst, src, chain in slices:
                    dst.copy_(src if len(chain) <= 2 else cast_along(src, chain))  # copy_ casts like .to()
                for src, chain, src_idx, dst_idx in gathers:
                    self.arena.index_copy_(0, dst_idx, cast_along(src.index_select(0, src_idx), chain).to(self.device))
                for x, values, scales in views:
                    self._quantize(x, values, scales)
        self.seconds = time.perf_counter() - began
        return self.seconds

    def _digest_table(self, regions: tuple[ServedRegion, ...], n_exposed: int):
        """(buffer, byte offset, bytes, key) rows hashed at publish: fp8 values and scales per piece, stage copies."""
        p, c = self.pieces, self.tables.copies
        staging = self.plan.staging
        served = served_copies(self.tables, self.rank)
        size = p.height * p.width
        keys = ([str(staging[s].weight) for s in p.stage.tolist()] + [str(staging[s].scale) for s in p.stage.tolist()]
                + [f"s{s}" for s in c.stage[served].tolist()])
        buffer = np.concatenate([np.full(len(p), n_exposed), np.full(len(p), n_exposed + 1),
                                 region_index(regions, c.take(served))])
        offset = np.concatenate([p.fp8_off, p.scale_off * 4, c.src_off[served] * 2])
        nbytes = np.concatenate([size, p.n_blocks * 4, c.length[served] * 2])
        return buffer, offset, nbytes, keys

    def digests(self, exposed: list[torch.Tensor]) -> dict[str, str]:
        buffer, offset, nbytes, keys = self._digest_rows
        buffers = [byte_view(x) for x in exposed] + [byte_view(self.fp8), byte_view(self.scales)]
        return digests(buffers, buffer, offset, nbytes, keys)
