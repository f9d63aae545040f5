"""The bounded ring: a trainer rank's packed runs cut into chunks that each fit the ring, served one after another."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ranks import Packing

DEFAULT_RING_BYTES = 512 << 20


@dataclass(frozen=True)
class RingChunks:
    """Consecutive packed runs (in packed order) cut so that each chunk fits the ring; chunk c is packed into
    the ring once every reader of chunk c - 1 acknowledged it."""

    first: np.ndarray  # index into Packing.run of each chunk's first run, then len(Packing.run)
    start: np.ndarray  # packed byte of each chunk's first run, then Packing.nbytes

    def __len__(self) -> int:
        return len(self.first) - 1

    @property
    def slot_bytes(self) -> int:
        """Bytes of the ring: the largest chunk."""
        return int(np.diff(self.start).max())

    def chunk_of(self, packed_byte: np.ndarray) -> np.ndarray:
        """Chunk of each packed offset (all >= 0)."""
        return np.searchsorted(self.start, packed_byte, side="right") - 1

    def part(self, packing: Packing, chunk: int) -> Packing:
        """Chunk `chunk` of `packing` as a packing of its own, its offsets counted from the ring's start."""
        lo, hi = int(self.first[chunk]), int(self.first[chunk + 1])
        shape = np.unique(np.clip(packing.shape, lo, hi)) - lo
        return Packing(packing.run[lo:hi], packing.packed_byte[lo:hi] - self.start[chunk], shape, packing.unit,
                       int(self.start[chunk + 1] - self.start[chunk]))


def ring_chunks(packing: Packing, ring_bytes: int) -> RingChunks | None:
    """The chunks of `packing` in a ring of `ring_bytes`; None when the whole packed region fits (served at once)."""
    if ring_bytes <= 0:
        raise ValueError(f"ring_bytes must be positive, got {ring_bytes}")
    if packing.nbytes <= ring_bytes:
        return None
    size = np.diff(np.append(packing.packed_byte, packing.nbytes))
    if size.max() > ring_bytes:
        raise ValueError(f"a packed run of {int(size.max())} bytes does not fit a ring of {ring_bytes} bytes; raise ring_bytes")
    first, used = [0], 0
    for i, n in enumerate(size.tolist()):
        if used + n > ring_bytes:
            first.append(i)
            used = 0
        used += n
    first.append(len(size))
    first = np.array(first, dtype=np.int64)
    return RingChunks(first, np.append(packing.packed_byte, packing.nbytes)[first])
