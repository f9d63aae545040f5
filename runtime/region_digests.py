"""Per-sync verification: SHA-256 per (trainer rank, destination entry) over the bytes of its runs, in plan order.

The sender hashes what it exposes, the receiver hashes what landed; equal digests prove the
bytes arrived unchanged (casts happen before the wire, so both sides hash the same bytes).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from .rank_tables import Reads


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor's memory (no copy)."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def run_digests(buffers: list[np.ndarray], buffer_of: np.ndarray, offsets: np.ndarray, reads: Reads) -> dict[int, str]:
    """{destination index: hex digest} of the runs in `reads`, reading run i at buffers[buffer_of[i]][offsets[i]:]."""
    hashers: dict[int, hashlib._Hash] = {}
    for buf, off, n, dest in zip(buffer_of.tolist(), offsets.tolist(), reads.nbytes.tolist(), reads.dest.tolist()):
        hasher = hashers.get(dest)
        if hasher is None:
            hasher = hashers[dest] = hashlib.sha256()
        hasher.update(buffers[buf][off : off + n])
    return {dest: h.hexdigest() for dest, h in hashers.items()}
