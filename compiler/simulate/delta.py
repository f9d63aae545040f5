"""Delta syncs in the model: the wire bytes of a page delta at a given density (runtime/delta/encode.py's own sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from weightplan.runtime.delta.encode import choose, encoded_sizes
from weightplan.runtime.delta.pages import PAGE_BYTES
from weightplan.runtime.errors import WeightplanError

INDEX_BYTES_PER_PAGE = 8  # the page index holds one int64 blob end per page
SAMPLE_PAGES = 16


class DeltaModelError(WeightplanError):
    """A delta density out of range, or a cluster without the rates a delta sync needs."""


@dataclass(frozen=True)
class DeltaSync:
    """A delta sync to model: `density` the changed fraction of wire units; encoding and applying at the cluster's
    `delta_encode_gbytes_per_s` (page bytes a trainer diffs per second) and `delta_apply_gbytes_per_s` (delta bytes a
    receiver decodes and writes into its destinations per second)."""

    density: float

    def __post_init__(self):
        if not 0.0 < self.density <= 1.0:
            raise DeltaModelError(f"delta density must be in (0, 1], got {self.density!r}")

    def wire_ratio(self, unit_bytes: dict[int, float]) -> float:
        """Delta bytes over full bytes for a plan whose wire bytes are `unit_bytes` ({unit size: bytes}), page index
        included."""
        total = sum(unit_bytes.values())
        if not total:
            return 0.0
        return sum(b * page_ratio(self.density, unit) for unit, b in unit_bytes.items()) / total


@lru_cache(maxsize=256)
def page_ratio(density: float, unit: int) -> float:
    """Bytes of the chosen encoding (runtime/delta/encode.py) over page bytes, for pages of `unit`-byte units whose
    units changed independently with probability `density`: the mean over SAMPLE_PAGES pages drawn with a fixed seed,
    plus the page index. Real changes cluster a little (bench-delta measured 0.034 at density 0.021, this gives 0.031)."""
    n = PAGE_BYTES // unit
    rng = np.random.default_rng(0)
    total = 0
    for _ in range(SAMPLE_PAGES):
        positions = np.flatnonzero(rng.random(n) < density)
        encoding = choose(n, unit, positions)
        total += 0 if encoding is None else encoded_sizes(n, unit, positions)[encoding]
    return total / (SAMPLE_PAGES * PAGE_BYTES) + INDEX_BYTES_PER_PAGE / PAGE_BYTES
