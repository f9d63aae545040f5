"""The delta codec on device tensors: a publish's pages diffed and encoded, a version's blobs decoded, checked and
scattered, by the Triton kernels of runtime/delta/triton_kernels.py, into the very bytes the numba kernels write.

The choice between encodings, the region's capacity, the header checks and the mapping through READ targets are the
host path's (kernels.encode_pages, kernels.count_changes, apply.writes_of) in torch ops on the device; a refused blob
is named by encode.decode, as on the host. One host synchronisation per publish and per decode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .apply import Changes, KeyedTargets, RefusedBlob, Writes
from .encode import HEADER_BYTES, DeltaError, Encoding, decode
from .pages import Pages

BLOCK = 1024  # units (encode), blob bytes or units (decode), changes (scatter) per step of one program
UNIT_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_LOG2 = {1: 0, 2: 1, 4: 2, 8: 3}


def triton_kernels():
    """runtime/delta/triton_kernels.py, imported on first use (triton is imported only on the device path)."""
    from . import triton_kernels as kernels

    return kernels


@dataclass(frozen=True)
class DeviceSpace:
    """One page space's pages as the kernels take them: their rows, first unit, units and first unit in `previous`."""

    unit: int
    rows: torch.Tensor
    start: torch.Tensor
    units: torch.Tensor
    prev_at: torch.Tensor
    previous_byte: int  # where the space's previous pages start in the previous-version buffer
    nbytes: int


@dataclass(frozen=True)
class Encoded:
    """One publish's delta, as kernels.encode_pages reports it over every space."""

    ends: np.ndarray  # each page row's blob end in the region
    used: int
    fits: bool
    changed_units: int
    kinds: np.ndarray  # blobs written per encoding id


class DeviceEncoder:
    """Diff and encode a trainer's pages on `device`: the spaces of `pages` in publish order, each space's previous
    pages back to back from `previous_at[space]` (bytes) of the previous-version buffer."""

    def __init__(self, pages: Pages, spaces: list[tuple[int, int, np.ndarray]], previous_at: np.ndarray,
                 device: torch.device):
        def on(a):
            return torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64), device=device)

        self.spaces = []
        for (_, _, rows), at in zip(spaces, previous_at.tolist()):
            unit = int(pages.unit[rows[0]])
            units = pages.nbytes[rows] // unit
            self.spaces.append(DeviceSpace(unit, on(rows), on(pages.start[rows] // unit), on(units),
                                           on(np.cumsum(units) - units), int(at), int(pages.nbytes[rows].sum())))
        self.n, self.unit = on(pages.nbytes // pages.unit), on(pages.unit)
        self.device = device

    def encode(self, served: Callable[[int], torch.Tensor], previous: torch.Tensor, out: torch.Tensor, capacity: int,
               fits: bool) -> Encoded:
        """encode_pages over every space from byte 0 of `out`: `served(i)` the uint8 bytes of space i as served now
        (called in order: a ring packs each chunk into the same buffer), `previous` the uint8 previous-version buffer
        (updated to them). The region's offsets and capacity are carried on the device: one host sync at the end."""
        k = triton_kernels()
        count = torch.zeros(len(self.n), dtype=torch.int64, device=self.device)
        gap_bytes, encoding, ends = torch.zeros_like(count), torch.zeros_like(count), torch.zeros_like(count)
        used = torch.zeros((), dtype=torch.int64, device=self.device)
        fitting = torch.tensor(bool(fits), device=self.device)
        for i, space in enumerate(self.spaces):
            cur = served(i)
            if not len(space.rows):
                continue
            dtype = UNIT_TORCH[space.unit]
            cur = cur[: cur.numel() // space.unit * space.unit].view(dtype)
            prev = previous[space.previous_byte : space.previous_byte + space.nbytes].view(dtype)
            k.diff_stats[(len(space.rows),)](cur, prev, space.start, space.units, space.prev_at, space.rows, count,
                                             gap_bytes, BLOCK=BLOCK)
            chosen, size = choose(self.n[space.rows], self.unit[space.rows], count[space.rows], gap_bytes[space.rows])
            end = used + torch.cumsum(size, 0)
            fit = fitting & (end <= capacity)
            encoding[space.rows] = torch.where(fit, chosen, 0)
            offset = torch.zeros_like(count)
            offset[space.rows] = end - size
            k.encode_write[(len(space.rows),)](cur, prev, space.start, space.units, space.prev_at, space.rows, encoding,
                                               count, offset, out, UNIT=space.unit, LOG2_UNIT=_LOG2[space.unit],
                                               BLOCK=BLOCK)
            used = torch.where(fit, end, used).max()
            ends[space.rows] = torch.where(fit, end, used)
            fitting = fitting & fit.all()
        used, all_fit, changed = torch.stack([used, fitting.to(torch.int64), count.sum()]).tolist()
        kinds = torch.bincount(encoding, minlength=max(Encoding) + 1).cpu().numpy()
        kinds[0] = 0
        return Encoded(ends.cpu().numpy(), int(used), bool(all_fit), int(changed), kinds)


def choose(n: torch.Tensor, unit: torch.Tensor, count: torch.Tensor, gap_bytes: torch.Tensor):
    """encode.choose per page (encoding id, 0 for an unchanged page; its blob's bytes)."""
    body = HEADER_BYTES + count * unit
    best = torch.full_like(count, int(Encoding.BITMASK))
    size = body + (n + 7) // 8
    indices = body + count * torch.where(n <= 1 << 16, 2, 4)
    best, size = torch.where(indices < size, int(Encoding.INDICES), best), torch.minimum(indices, size)
    gaps = body + gap_bytes
    best, size = torch.where(gaps < size, int(Encoding.GAPS), best), torch.minimum(gaps, size)
    raw = size >= n * unit
    best, size = torch.where(raw, int(Encoding.RAW), best), torch.where(raw, HEADER_BYTES + n * unit, size)
    changed = count > 0
    return torch.where(changed, best, 0), torch.where(changed, size, 0)


def decode_all(staged: torch.Tensor, start: np.ndarray, length: np.ndarray, rows: np.ndarray, pages: Pages,
               keys: np.ndarray) -> Changes:
    """apply.decode_all on a device staging buffer: Changes of device tensors (keys int64, values as int64 bit
    patterns); RefusedBlob for the first page encode.decode refuses, before anything is returned."""
    device = staged.device
    start, length, rows = (np.ascontiguousarray(a, dtype=np.int64) for a in (start, length, rows))
    unit_np = pages.unit[rows].astype(np.int64)
    n_np = pages.nbytes[rows] // unit_np
    if not len(rows):
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return Changes(empty, empty.clone())
    on = lambda a: torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64), device=device)  # noqa: E731
    a, m, n, u = on(start), on(length), on(n_np), on(unit_np)
    header = staged[(a[:, None] + torch.arange(HEADER_BYTES, device=device)).clamp(0, max(staged.numel() - 1, 0))]
    header = header.to(torch.int64)
    enc, log2 = header[:, 0], header[:, 1]
    count = header[:, 4] | header[:, 5] << 8 | header[:, 6] << 16 | header[:, 7] << 24
    used = m > 0
    bad = used & ((m < HEADER_BYTES) | (enc < Encoding.RAW) | (enc > Encoding.GAPS) | (log2 > 3)
                  | ((1 << log2.clamp(max=3)) != u) | (count > n) | ((enc == Encoding.RAW) & (count != n))
                  | (m < HEADER_BYTES + count * u))
    count = torch.where(used & ~bad, count, 0)
    first = torch.cumsum(count, 0) - count
    first_bad, total = torch.stack([torch.where(bad, torch.arange(len(bad), device=device), len(bad)).min(),
                                    count.sum()]).tolist()
    if first_bad < len(bad):
        _refuse(staged, start, length, rows, n_np, unit_np, first_bad)
    out_keys = torch.empty(total, dtype=torch.int64, device=device)
    values = torch.empty(total, dtype=torch.int64, device=device)
    refused = torch.zeros(len(rows), dtype=torch.int32, device=device)
    triton_kernels().decode_blobs[(len(rows),)](staged, a, m, n, u, on(keys[rows]), first, out_keys, values, refused,
                                                BLOCK=BLOCK)
    first_refused = int(torch.where(refused != 0, torch.arange(len(rows), device=device), len(rows)).min())
    if first_refused < len(rows):
        _refuse(staged, start, length, rows, n_np, unit_np, first_refused)
    return Changes(out_keys, values)


def _refuse(staged, start, length, rows, n_units, unit, refused: int) -> None:
    """RefusedBlob naming the first page up to `refused` that encode.decode refuses (as apply.decode_all does)."""
    for i in range(refused + 1):
        blob = staged[start[i] : start[i] + length[i]].cpu().numpy()
        try:
            decode(blob, int(n_units[i]), int(unit[i]))
        except DeltaError as exc:
            raise RefusedBlob(int(rows[i]), str(exc)) from None
    raise RefusedBlob(int(rows[refused]), "a page delta the device decoder refuses")  # never: kernels match decode


def keyed_on(found: KeyedTargets, device: torch.device) -> KeyedTargets:
    """A receiver's KeyedTargets as device tensors (prepared once per trainer)."""
    return KeyedTargets(*(torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64), device=device)
                          for a in (found.key, found.nbytes, found.unit, found.entry, found.dst_byte)))


def writes_of(changes: Changes, found: KeyedTargets, entry_bytes: torch.Tensor) -> Writes:
    """apply.writes_of on device tensors (the same checks, the same DeltaError)."""
    lo = torch.searchsorted(changes.keys, found.key)
    hi = torch.searchsorted(changes.keys, found.key + found.nbytes)
    some = torch.nonzero(hi > lo).flatten()
    t = KeyedTargets(*(a[some] for a in (found.key, found.nbytes, found.unit, found.entry, found.dst_byte)))
    lo, hi = lo[some], hi[some]
    off = (t.dst_byte - t.key) % t.unit
    last = t.dst_byte + changes.keys[hi - 1] - t.key + t.unit if len(some) else lo
    misaligned, beyond = torch.stack([(off != 0).any(), (last > entry_bytes[t.entry]).any()]).tolist() \
        if len(some) else (False, False)
    if misaligned:
        raise DeltaError(f"a change lands off the {int(t.unit[int(torch.argmax((off != 0).to(torch.int8)))])}-byte "
                         "units of its destination")
    if beyond:
        raise DeltaError("a change lands beyond the end of its destination")
    return Writes(changes, t, lo, hi)


def apply_writes(writes: Writes, base: torch.Tensor, entry_at: torch.Tensor) -> int:
    """Scatter `writes` into the destinations: entry e's bytes start entry_at[e] bytes from `base` (a uint8 tensor
    on the same device); returns the units written."""
    t = writes.targets
    counts = writes.hi - writes.lo
    if not len(counts):
        return 0
    chunks = (counts + BLOCK - 1) // BLOCK
    target = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), chunks)
    before = torch.cumsum(chunks, 0) - chunks
    chunk_first = writes.lo[target] + (torch.arange(len(target), device=counts.device) - before[target]) * BLOCK
    if len(target):
        triton_kernels().scatter[(len(target),)](writes.changes.keys, writes.changes.values, target, chunk_first,
                                                 writes.hi, t.key, entry_at[t.entry] + t.dst_byte, t.unit, base,
                                                 BLOCK=BLOCK)
    return int(counts.sum())
