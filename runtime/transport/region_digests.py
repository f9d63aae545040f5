"""Per-sync verification: SHA-256 per (trainer rank, destination entry) over the bytes it sends, in plan order.

The sender hashes what it exposes, the receiver hashes what landed; equal digests prove the
bytes arrived unchanged (casts and sender-side fp8 quantization happen before the wire, so both sides
hash the same bytes; receiver-side staging is hashed before the receiver quantizes it).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..tables.ranks import Reads


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def run_digests(buffers, buffer_of: np.ndarray, offsets: np.ndarray, strides: np.ndarray, reads: Reads) -> dict[int, str]:
    """{destination index: hex digest} of the runs in `reads`, reading run i's rows at buffers[buffer_of[i]][offsets[i]:]
    `strides[i]` bytes apart."""
    return digests(buffers, buffer_of, offsets, reads.nbytes, reads.dest.tolist(), reads.count, strides)


def digests(buffers, buffer_of: np.ndarray, offsets: np.ndarray, nbytes: np.ndarray, keys: list,
            counts: np.ndarray | None = None, strides: np.ndarray | None = None) -> dict:
    """{key: hex digest} of byte ranges (each `counts[i]` rows `strides[i]` apart), each key's ranges hashed in the given order."""
    counts = np.ones(len(nbytes), dtype=np.int64) if counts is None else counts
    strides = np.zeros(len(nbytes), dtype=np.int64) if strides is None else strides
    hashers: dict = {}
    for buf, off, n, key, count, stride in zip(buffer_of.tolist(), offsets.tolist(), nbytes.tolist(), keys,
                                               counts.tolist(), strides.tolist()):
        hasher = hashers.get(key)
        if hasher is None:
            hasher = hashers[key] = hashlib.sha256()
        if count == 1 or stride == n:
            hasher.update(buffers[buf][off : off + n * count])
        else:
            rows = np.lib.stride_tricks.as_strided(buffers[buf][off:], (count, n), (stride, 1), writeable=False)
            hasher.update(np.ascontiguousarray(rows))
    return {key: h.hexdigest() for key, h in hashers.items()}
