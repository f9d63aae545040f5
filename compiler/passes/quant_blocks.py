"""Block geometry of quantized tensors, vectorised: which flat 128x128 block ids element ranges touch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightplan.runtime.fp8.numerics import BLOCK, block_grid


@dataclass(frozen=True)
class BlockGrids:
    """Per tensor (row i of `shapes`): rows, cols, block rows, block cols, and its first block in one id space."""

    rows: np.ndarray
    cols: np.ndarray
    nbr: np.ndarray
    nbc: np.ndarray
    base: np.ndarray  # len(shapes) + 1 entries: tensor i's blocks are [base[i], base[i + 1])

    @staticmethod
    def of(shapes) -> "BlockGrids":
        grids = [block_grid(tuple(shape)) for shape in shapes]
        counts = np.array([m * r * c for m, r, c in grids], dtype=np.int64)
        return BlockGrids(
            np.array([shape[-2] for shape in shapes], dtype=np.int64).reshape(-1),
            np.array([shape[-1] for shape in shapes], dtype=np.int64).reshape(-1),
            np.array([r for _, r, _ in grids], dtype=np.int64).reshape(-1),
            np.array([c for _, _, c in grids], dtype=np.int64).reshape(-1),
            np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
        )


def block_intervals(grids: BlockGrids, tensor: np.ndarray, off: np.ndarray, length: np.ndarray):
    """Block ids [lo, hi) touched by elements [off, off + length) of `tensor`, in the shared id space.

    Each range gives up to three intervals (its first row's blocks, the whole bands of the rows
    between, its last row's blocks; they may overlap). Returns (item, lo, hi): item indexes the input.
    """
    rows, cols, nbr, nbc, base = grids.rows[tensor], grids.cols[tensor], grids.nbr[tensor], grids.nbc[tensor], grids.base[tensor]

    def band(g):
        return (g // rows) * nbr + (g % rows) // BLOCK

    g0, c0 = np.divmod(off, cols)
    g1, c1 = np.divmod(off + length - 1, cols)
    one_row = g0 == g1
    first_lo = band(g0) * nbc + c0 // BLOCK
    first_hi = np.where(one_row, band(g0) * nbc + c1 // BLOCK + 1, band(g0) * nbc + nbc)
    middle = g1 - g0 > 1
    middle_lo = band(g0 + 1) * nbc
    middle_hi = (band(np.maximum(g1 - 1, 0)) + 1) * nbc
    last_lo = band(g1) * nbc
    last_hi = last_lo + c1 // BLOCK + 1
    items = np.arange(len(off))
    pick_m, pick_l = np.flatnonzero(middle), np.flatnonzero(~one_row)
    item = np.concatenate([items, pick_m, pick_l])
    lo = np.concatenate([first_lo, middle_lo[pick_m], last_lo[pick_l]])
    hi = np.concatenate([first_hi, middle_hi[pick_m], last_hi[pick_l]])
    return item, base[item] + lo, base[item] + hi

