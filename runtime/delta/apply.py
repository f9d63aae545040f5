"""Turning one trainer rank's delta blobs into writes of destination bytes, batched over all its pages, and applying them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .encode import DeltaError, decode
from .pages import Pages, Targets

if TYPE_CHECKING:
    from numba import typed


def delta_kernels():
    """runtime/delta/kernels.py, imported on first use: numba loads llvmlite, and a vLLM CPU worker that imports this
    package (through the backend plugin) before it starts would fail in vLLM's Triton-override scan of sys.modules
    (`triton_utils/dispatcher.py:_rebind_kernels` reads `vars()` of llvmlite's `ffi.lib`, whose `__dict__` is not one)."""
    from . import kernels

    return kernels


_SPACE_SHIFT = 40  # a key is (the space's ordinal among the trainer's page spaces) << 40 | the byte in that space


class RefusedBlob(DeltaError):
    """A blob does not fit its page: `row` is the page, the message encode.decode's."""

    def __init__(self, row: int, message: str):
        super().__init__(message)
        self.row = row


@dataclass(frozen=True)
class KeyedTargets:
    """A trainer's Targets in key order: target t writes changes with keys in [key[t], key[t] + nbytes[t]) into entry
    `entry[t]` at dst_byte[t] + (change key - key[t]), `unit[t]` bytes each (its page space's unit)."""

    key: np.ndarray
    nbytes: np.ndarray
    unit: np.ndarray
    entry: np.ndarray
    dst_byte: np.ndarray


def page_keys(pages: Pages) -> np.ndarray:
    """The key of every page's first byte (increasing in page order)."""
    key = pages.space * (1 << 32) + pages.index
    ordinal = np.concatenate([[0], np.cumsum(np.diff(key) != 0)]) if len(pages) else np.zeros(0, dtype=np.int64)
    return (ordinal.astype(np.int64) << _SPACE_SHIFT) + pages.start


def keyed_targets(pages: Pages, found: Targets) -> KeyedTargets:
    """`found` in key order, keeping the targets of spaces `pages` has."""
    spaces, first = np.unique(pages.space * (1 << 32) + pages.index, return_index=True)  # publish order: ordinals
    target_space = found.space * (1 << 32) + found.index
    at = np.minimum(np.searchsorted(spaces, target_space), max(len(spaces) - 1, 0))
    mine = np.flatnonzero(spaces[at] == target_space) if len(spaces) else np.zeros(0, dtype=np.int64)
    at = at[mine]
    keys = (at.astype(np.int64) << _SPACE_SHIFT) + found.start[mine]
    order = np.argsort(keys, kind="stable")
    return KeyedTargets(keys[order], found.nbytes[mine][order].astype(np.int64), pages.unit[first[at]][order].astype(np.int64),
                        found.entry[mine][order].astype(np.int64), found.dst_byte[mine][order].astype(np.int64))


@dataclass(frozen=True)
class Changes:
    """A trainer's decoded delta: every changed unit's key, increasing, and its new bytes as a little-endian integer."""

    keys: np.ndarray
    values: np.ndarray


def decode_all(staged: np.ndarray, start: np.ndarray, length: np.ndarray, rows: np.ndarray, pages: Pages,
               keys: np.ndarray) -> Changes:
    """Decode the blobs staged at `start` (`length` bytes; of page rows `rows`, in page order) in one pass; `keys`:
    page_keys(pages). RefusedBlob (the first page, in order, that encode.decode refuses) before anything is returned."""
    start, length, rows = (np.ascontiguousarray(a, dtype=np.int64) for a in (start, length, rows))
    unit = pages.unit[rows].astype(np.int64)
    n_units = pages.nbytes[rows] // unit
    refused, total = delta_kernels().count_changes(staged, start, length, n_units, unit)
    if refused < 0:
        out_keys, values = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.uint64)
        refused = delta_kernels().decode_blobs(staged, start, length, n_units, unit, keys[rows], out_keys, values)
        if refused < 0:
            return Changes(out_keys, values)
    for i in range(refused + 1):  # the reference names the first refused page
        try:
            decode(staged[start[i] : start[i] + length[i]], int(n_units[i]), int(unit[i]))
        except DeltaError as exc:
            raise RefusedBlob(int(rows[i]), str(exc)) from None
    raise RefusedBlob(int(rows[refused]), "a page delta the batched decoder refuses")  # never: kernels match decode


@dataclass(frozen=True)
class Writes:
    """Changes mapped through targets: changes lo[t]:hi[t] go through target t (targets with none left out)."""

    changes: Changes
    targets: KeyedTargets
    lo: np.ndarray
    hi: np.ndarray

    @property
    def units(self) -> int:
        return int((self.hi - self.lo).sum())


def writes_of(changes: Changes, found: KeyedTargets, entry_bytes: np.ndarray) -> Writes:
    """The destination writes of `changes` through every target that reads their bytes (a byte several targets read,
    e.g. one source feeding two entries, is written to each); `entry_bytes`: each entry's size. DeltaError if a change
    would land off its destination's units or beyond it."""
    lo = np.searchsorted(changes.keys, found.key)
    hi = np.searchsorted(changes.keys, found.key + found.nbytes)
    some = np.flatnonzero(hi > lo)
    t = KeyedTargets(*(a[some] for a in (found.key, found.nbytes, found.unit, found.entry, found.dst_byte)))
    lo, hi = lo[some], hi[some]
    if np.any((t.dst_byte - t.key) % t.unit):
        raise DeltaError(f"a change lands off the {int(t.unit[np.argmax((t.dst_byte - t.key) % t.unit != 0)])}-byte "
                         "units of its destination")
    last = t.dst_byte + changes.keys[hi - 1] - t.key + t.unit if len(some) else lo
    if np.any(last > entry_bytes[t.entry]):
        raise DeltaError("a change lands beyond the end of its destination")
    return Writes(changes, t, lo, hi)


def destination_list(destinations: dict[int, np.ndarray], entries: int) -> typed.List:
    """Flat uint8 views of the entries held ({entry: view}), indexed by entry (empty for the others), for apply_writes."""
    from numba import typed

    out = typed.List()
    empty = np.zeros(0, dtype=np.uint8)
    for entry in range(entries):
        out.append(destinations.get(entry, empty))
    return out


def apply_writes(writes: Writes, destinations: typed.List) -> int:
    """Write every change of `writes` into its entries' bytes (destination_list's); returns the units written."""
    t = writes.targets
    return int(delta_kernels().scatter(destinations, writes.changes.keys, writes.changes.values, t.unit, writes.lo, writes.hi,
                               t.key, t.entry, t.dst_byte))


def warm_up() -> None:
    """Compile the decode and scatter kernels now, or load them from numba's cache (about a second in a fresh process),
    so that the first delta sync does not pay it."""
    empty = np.zeros(0, dtype=np.int64)
    pages = Pages(empty, empty, empty, empty, empty)
    changes = decode_all(np.zeros(0, dtype=np.uint8), empty, empty, empty, pages, empty)
    writes = writes_of(changes, KeyedTargets(empty, empty, empty, empty, empty), empty)
    apply_writes(writes, destination_list({0: np.zeros(1, dtype=np.uint8)}, 1))
