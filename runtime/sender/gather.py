"""Gather many byte ranges of a few source tensors into one buffer with index_select/index_copy_, planned once."""

from __future__ import annotations

import numpy as np
import torch

UNIT_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def index_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated aranges [start, start + length) as one int64 index array."""
    total = int(lengths.sum())
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return (np.arange(total, dtype=np.int64) + shift).astype(np.int64)


def units(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor's bytes seen as `dtype` elements (a trailing partial element is left out)."""
    raw = tensor.reshape(-1).view(torch.uint8)
    size = torch.tensor([], dtype=dtype).element_size()
    return raw[: raw.numel() // size * size].view(dtype)


class Gather:
    """Copies byte ranges (source tensor i, src_byte, nbytes) to out_byte of one output, in the largest common unit.

    Each index lives on the device of the tensor it indexes, so a GPU rank gathers on its GPU; a source on another
    device than the output (host next to GPU tensors) is selected where it is and copied over.
    """

    def __init__(self, tensors: list[torch.Tensor], out: torch.Tensor, source: np.ndarray, src_byte: np.ndarray,
                 nbytes: np.ndarray, out_byte: np.ndarray, unit: int):
        while unit > 1 and any(t.data_ptr() % unit for t in [*tensors, out]):
            unit //= 2
        self.dtype = UNIT_DTYPES[unit]
        self.tensors, self.out = tensors, out
        self.steps = []
        for i in np.unique(source).tolist():
            rows = source == i
            src = torch.from_numpy(index_ranges(src_byte[rows] // unit, nbytes[rows] // unit)).to(tensors[i].device)
            dst = torch.from_numpy(index_ranges(out_byte[rows] // unit, nbytes[rows] // unit)).to(out.device)
            self.steps.append((i, src, dst))

    def __call__(self) -> None:
        out = units(self.out, self.dtype)
        for i, src, dst in self.steps:
            out.index_copy_(0, dst, units(self.tensors[i], self.dtype).index_select(0, src).to(out.device))
