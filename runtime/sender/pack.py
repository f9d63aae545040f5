"""Pack a trainer rank's small strided runs into its packed region: one gather per span of equally shaped runs."""

from __future__ import annotations

import numpy as np
import torch

from ..tables.ranks import Packing, Reads
from .gather import UNIT_DTYPES, units


class PackRuns:
    """Copies every packed stored run (rows at src_byte + i*src_stride) to its block of the packed region.

    Consecutive runs of one shape sit back to back in the packed region (tables/ranks.py: Packing), so
    each such span is one `index_select` over a strided view of its source region whose first dimension
    is every start offset: the only index is one start per stored run, never one per row or byte.
    """

    def __init__(self, tensors: list[torch.Tensor], out: torch.Tensor, packing: Packing, served: Reads):
        unit = packing.unit
        while unit > 1 and any(t.data_ptr() % unit for t in [*tensors, out]):
            unit //= 2
        self.dtype, self.tensors, self.out = UNIT_DTYPES[unit], tensors, out
        runs = served.take(np.searchsorted(served.run, packing.run))
        self.steps = []  # (source tensor, rows, row units, stride units, starts, first packed unit)
        for lo, hi in zip(packing.shape[:-1].tolist(), packing.shape[1:].tolist()):
            if hi > lo:
                count, stride = int(runs.count[lo]), int(runs.src_stride[lo]) if runs.count[lo] > 1 else 0
                self.steps.append((int(runs.region[lo]), count, int(runs.nbytes[lo]) // unit, stride // unit,
                                   torch.from_numpy(runs.src_byte[lo:hi] // unit), int(packing.packed_byte[lo]) // unit))

    @property
    def table_bytes(self) -> int:
        return sum(step[4].numel() * 8 for step in self.steps)

    def __call__(self) -> None:
        out = units(self.out, self.dtype)
        for source, count, width, stride, starts, at in self.steps:
            src = units(self.tensors[source], self.dtype)
            extent = (count - 1) * stride + width
            every = src.as_strided((src.numel() - extent + 1, count, width), (1, stride, 1))
            torch.index_select(every, 0, starts, out=out[at : at + len(starts) * count * width].view(-1, count, width))
