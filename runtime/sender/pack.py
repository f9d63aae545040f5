"""Pack a trainer rank's small strided runs into its packed region: one gather per span of equally shaped runs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..casts import cast_into
from ..tables.ranks import Packing, Reads
from .gather import UNIT_DTYPES, units


@dataclass(frozen=True)
class CastSource:
    """A region served only from the packed region: its rows are cast from the source straight into it (no staging)."""

    source: torch.Tensor  # the trainer's flat local shard, in its own dtype
    chain: tuple[str, ...]  # the region's cast chain
    wire: torch.dtype


class PackRuns:
    """Copies every packed stored run (rows at src_byte + i*src_stride) to its block of the packed region.

    Consecutive runs of one shape sit back to back in the packed region (tables/ranks.py: Packing), so
    each such span is one `index_select` over a strided view of its source region whose first dimension
    is every start offset: the only index is one start per stored run, never one per row or byte.

    Regions in `casts` have no exposed tensor (None in `tensors`): their spans gather elements of the
    trainer's own tensor and cast them into the packed region, so their bytes are staged once, not twice.
    """

    def __init__(self, tensors: list[torch.Tensor | None], out: torch.Tensor, packing: Packing, served: Reads,
                 casts: dict[int, CastSource] | None = None):
        self.casts = casts or {}
        unit = packing.unit
        while unit > 1 and any(t.data_ptr() % unit for t in [*(t for t in tensors if t is not None), out]):
            unit //= 2
        self.dtype, self.tensors, self.out = UNIT_DTYPES[unit], tensors, out
        runs = served.take(np.searchsorted(served.run, packing.run))
        self.steps = []  # (source tensor, rows, row units, stride units, starts, first packed unit)
        for lo, hi in zip(packing.shape[:-1].tolist(), packing.shape[1:].tolist()):
            if hi > lo:
                region = int(runs.region[lo])
                # a cast region's units are its wire elements, which index the source's elements one to one
                size = self.casts[region].wire.itemsize if region in self.casts else unit
                count, stride = int(runs.count[lo]), int(runs.src_stride[lo]) if runs.count[lo] > 1 else 0
                self.steps.append((region, count, int(runs.nbytes[lo]) // size, stride // size,
                                   torch.from_numpy(runs.src_byte[lo:hi] // size), int(packing.packed_byte[lo]) // size))

    @property
    def table_bytes(self) -> int:
        return sum(step[4].numel() * 8 for step in self.steps)

    def __call__(self) -> None:
        out = units(self.out, self.dtype)
        for source, count, width, stride, starts, at in self.steps:
            cast = self.casts.get(source)
            src = units(self.tensors[source], self.dtype) if cast is None else cast.source
            extent = (count - 1) * stride + width
            every = src.as_strided((src.numel() - extent + 1, count, width), (1, stride, 1))
            starts = starts.to(src.device)  # a no-op on the host; a GPU source gathers on its device
            if cast is None and src.device == out.device:
                torch.index_select(every, 0, starts, out=out[at : at + len(starts) * count * width].view(-1, count, width))
            elif cast is None:  # a source on another device than the packed region (host next to GPU tensors)
                out[at : at + len(starts) * count * width].view(-1, count, width).copy_(torch.index_select(every, 0, starts))
            else:
                size = cast.wire.itemsize
                into = self.out[at * size : (at + len(starts) * count * width) * size].view(cast.wire).view(-1, count, width)
                cast_into(into, torch.index_select(every, 0, starts), cast.chain)
