"""Turning one trainer rank's decoded page deltas into writes of destination units, and applying them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .encode import UNIT_DTYPES, DeltaError, PageDelta
from .pages import Pages, Targets


@dataclass(frozen=True)
class UnitWrites:
    """New values for units of one destination entry: values[i] goes to unit `index[i]` (units of `unit` bytes)."""

    entry: int
    unit: int
    index: np.ndarray
    values: np.ndarray


def writes_of(pages: Pages, deltas: dict[int, PageDelta], found: Targets) -> list[UnitWrites]:
    """The destination writes of decoded page deltas ({page row: delta}), through every target that reads their bytes
    (a byte several targets read, e.g. one source feeding two entries, is written to each)."""
    out: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
    for space, index, rows in pages.spaces():
        changed = [r for r in rows.tolist() if deltas.get(r) is not None]
        mine = np.flatnonzero((found.space == space) & (found.index == index))
        if not changed or not len(mine):
            continue
        unit = int(pages.unit[rows[0]])
        at = np.concatenate([pages.start[r] + unit * (np.arange(len(deltas[r].values)) if deltas[r].positions is None
                                                      else deltas[r].positions) for r in changed])
        values = np.concatenate([deltas[r].values for r in changed])
        lo = np.searchsorted(at, found.start[mine])
        hi = np.searchsorted(at, found.start[mine] + found.nbytes[mine])
        n = hi - lo
        pick = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        entry = np.repeat(found.entry[mine], n)
        byte = np.repeat(found.dst_byte[mine] - found.start[mine], n) + at[pick]
        if np.any(byte % unit):
            raise DeltaError(f"a change lands off the {unit}-byte units of its destination")
        order = np.argsort(entry, kind="stable")
        cuts = np.flatnonzero(np.diff(entry[order])) + 1
        for sel in np.split(order, cuts):
            if len(sel):
                out.setdefault((int(entry[sel[0]]), unit), []).append((byte[sel] // unit, values[pick[sel]]))
    return [UnitWrites(e, unit, np.concatenate([i for i, _ in parts]), np.concatenate([v for _, v in parts]))
            for (e, unit), parts in out.items()]


def apply_writes(writes: list[UnitWrites], destinations: dict[int, np.ndarray]) -> int:
    """Write every UnitWrites into its entry's bytes (`destinations`: {entry: flat uint8 view}); returns the units written."""
    for w in writes:
        destinations[w.entry].view(UNIT_DTYPES[w.unit])[w.index] = w.values
    return sum(len(w.index) for w in writes)
