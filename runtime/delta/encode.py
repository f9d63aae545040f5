"""The delta encoding of one page of wire bytes: which units changed since the previous version, and their new values.

A page is `n` units of `unit` bytes (the wire element size: 2 for bf16, 4 for fp32 and scales, 1 for fp8). Its
delta is one blob: an 8-byte header (encoding, log2 of the unit, count of changed units), the changed units'
new bytes in position order, then their positions in one of three encodings, whichever is smallest:

- BITMASK: one bit per unit of the page (ceil(n / 8) bytes), little-endian bit order;
- INDICES: each position as a little-endian uint16 (uint32 for pages of 65536 units or more);
- GAPS: each position minus the previous position minus one (the first: the position itself), as LEB128 varints.

A page whose delta would be at least its own size is sent RAW (header + every unit); an unchanged page has the
empty delta (zero bytes). Decoding checks every field against the page it claims to describe and raises
DeltaError naming the first that does not fit, before anything is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

HEADER_BYTES = 8
UNIT_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
_MAX_VARINT_BYTES = 5  # 35 bits: more than any page position


class DeltaError(ValueError):
    """A delta blob does not describe the page it is applied to (truncated, out of range, inconsistent)."""


class Encoding(enum.IntEnum):
    """How a page's delta spells its changed positions (RAW: it carries every unit instead)."""

    RAW = 1
    BITMASK = 2
    INDICES = 3
    GAPS = 4


@dataclass(frozen=True)
class PageDelta:
    """A decoded page delta: the new `values` (unit integers) at `positions` (units, increasing); None for RAW
    (values is then the whole page)."""

    encoding: Encoding
    positions: np.ndarray | None
    values: np.ndarray


def index_dtype(n_units: int) -> np.dtype:
    return np.dtype("<u2") if n_units <= 1 << 16 else np.dtype("<u4")


def changed(previous: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Positions (int64, increasing) where two equally long arrays of unit integers differ."""
    return np.flatnonzero(previous != current)


def gaps_of(positions: np.ndarray) -> np.ndarray:
    return np.diff(positions, prepend=-1) - 1


_VARINT_LIMITS = np.array([1 << (7 * i) for i in range(1, _MAX_VARINT_BYTES)], dtype=np.int64)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    return np.searchsorted(_VARINT_LIMITS, values.astype(np.int64), side="right") + 1


def encoded_sizes(n_units: int, unit: int, positions: np.ndarray) -> dict[Encoding, int]:
    """Bytes of the page's delta in every encoding (the header included)."""
    k = len(positions)
    body = HEADER_BYTES + k * unit
    return {Encoding.RAW: HEADER_BYTES + n_units * unit, Encoding.BITMASK: body + (n_units + 7) // 8,
            Encoding.INDICES: body + k * index_dtype(n_units).itemsize,
            Encoding.GAPS: body + int(varint_lengths(gaps_of(positions)).sum())}


def choose(n_units: int, unit: int, positions: np.ndarray) -> Encoding | None:
    """The smallest encoding of these changes, RAW when none is smaller than the page; None when nothing changed."""
    if not len(positions):
        return None
    sizes = encoded_sizes(n_units, unit, positions)
    best = min((Encoding.BITMASK, Encoding.INDICES, Encoding.GAPS), key=sizes.__getitem__)
    return best if sizes[best] < n_units * unit else Encoding.RAW


def encode(current: np.ndarray, positions: np.ndarray, encoding: Encoding | None = None) -> np.ndarray:
    """The delta blob (uint8) of a page whose units `current` (a unit-integer array) changed at `positions`; empty when
    nothing changed. `encoding` forces one (tests and benchmarks); by default `choose` picks it."""
    n, unit = len(current), current.dtype.itemsize
    if encoding is None:
        encoding = choose(n, unit, positions)
        if encoding is None:
            return np.zeros(0, dtype=np.uint8)
    header = np.zeros(HEADER_BYTES, dtype=np.uint8)
    header[0], header[1] = int(encoding), unit.bit_length() - 1
    if encoding is Encoding.RAW:
        header[4:8] = np.frombuffer(np.uint32(n).tobytes(), dtype=np.uint8)
        return np.concatenate([header, current.view(np.uint8)])
    header[4:8] = np.frombuffer(np.uint32(len(positions)).tobytes(), dtype=np.uint8)
    values = current[positions].view(np.uint8)
    if encoding is Encoding.BITMASK:
        bits = np.zeros(n, dtype=bool)
        bits[positions] = True
        spelled = np.packbits(bits, bitorder="little")
    elif encoding is Encoding.INDICES:
        spelled = positions.astype(index_dtype(n)).view(np.uint8)
    else:
        spelled = _varints(gaps_of(positions))
    return np.concatenate([header, values, spelled])


def decode(blob: np.ndarray, n_units: int, unit: int) -> PageDelta | None:
    """The changes a blob (uint8) spells for a page of `n_units` units of `unit` bytes; None for the empty delta.
    DeltaError if the blob does not fit that page."""
    if not len(blob):
        return None
    if len(blob) < HEADER_BYTES:
        raise DeltaError(f"a page delta of {len(blob)} bytes is shorter than its {HEADER_BYTES}-byte header")
    try:
        encoding = Encoding(int(blob[0]))
    except ValueError:
        raise DeltaError(f"unknown page delta encoding {int(blob[0])}") from None
    if 1 << int(blob[1]) != unit or int(blob[1]) > 3:
        raise DeltaError(f"a page delta of {1 << min(int(blob[1]), 63)}-byte units for a page of {unit}-byte units")
    count = int(blob[4:8].view("<u4")[0])
    if count > n_units or (encoding is Encoding.RAW and count != n_units):
        raise DeltaError(f"a page delta of {count} changed units for a page of {n_units}")
    dtype = UNIT_DTYPES[unit]
    end = HEADER_BYTES + count * unit
    if len(blob) < end:
        raise DeltaError(f"a page delta of {len(blob)} bytes is shorter than its {count} values of {unit} bytes")
    values = blob[HEADER_BYTES:end].view(dtype)  # numpy allows unaligned views
    spelled = blob[end:]
    if encoding is Encoding.RAW:
        if len(spelled):
            raise DeltaError(f"a raw page delta carries {len(spelled)} bytes beyond its page")
        return PageDelta(encoding, None, values)
    if encoding is Encoding.BITMASK:
        if len(spelled) != (n_units + 7) // 8:
            raise DeltaError(f"a bitmask of {len(spelled)} bytes for a page of {n_units} units")
        bits = np.unpackbits(spelled, bitorder="little")
        if bits[n_units:].any():
            raise DeltaError(f"a bitmask marks units beyond the page's {n_units}")
        positions = np.flatnonzero(bits)
    elif encoding is Encoding.INDICES:
        isz = index_dtype(n_units).itemsize
        if len(spelled) != count * isz:
            raise DeltaError(f"{len(spelled)} bytes of indices for {count} changed units")
        positions = np.frombuffer(spelled.tobytes(), dtype=index_dtype(n_units)).astype(np.int64)
        if count and (np.any(np.diff(positions) <= 0) or positions[-1] >= n_units):
            raise DeltaError(f"indices not increasing within the page's {n_units} units")
    else:
        gaps = _from_varints(spelled, count)
        positions = np.cumsum(gaps + 1) - 1
        if count and positions[-1] >= n_units:
            raise DeltaError(f"gaps reach unit {int(positions[-1])} of a page of {n_units}")
    if len(positions) != count:
        raise DeltaError(f"a page delta says {count} changed units, its positions give {len(positions)}")
    return PageDelta(encoding, positions.astype(np.int64), values)


def apply(page: np.ndarray, delta: PageDelta | None) -> None:
    """Write a decoded delta into `page` (the unit-integer array it was decoded for)."""
    if delta is None:
        return
    if delta.positions is None:
        page[:] = delta.values
    else:
        page[delta.positions] = delta.values


def _varints(values: np.ndarray) -> np.ndarray:
    """LEB128 bytes of unsigned integers (below 2**35), vectorized."""
    if not len(values) or values.max() < 0x80:  # every gap one byte: the common case below ~5% density
        return values.astype(np.uint8)
    lengths = varint_lengths(values)
    starts = np.cumsum(lengths) - lengths
    values = values.astype(np.int64)
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    for digit in range(int(lengths.max())):  # one scatter per varint byte, never one index per byte
        longer = np.flatnonzero(lengths > digit)
        out[starts[longer] + digit] = ((values[longer] >> (7 * digit)) & 0x7F) | ((lengths[longer] > digit + 1) << 7)
    return out


def _from_varints(spelled: np.ndarray, count: int) -> np.ndarray:
    """`count` unsigned integers from LEB128 bytes that must hold exactly them; DeltaError otherwise."""
    ends = np.flatnonzero(spelled < 0x80)
    if len(ends) != count or (count and ends[-1] != len(spelled) - 1) or (not count and len(spelled)):
        raise DeltaError(f"{len(spelled)} bytes of gaps do not spell {count} varints")
    if not count:
        return np.zeros(0, dtype=np.int64)
    if count == len(spelled):  # every gap one byte
        return spelled.astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    widest = int(lengths.max())
    if widest > _MAX_VARINT_BYTES:
        raise DeltaError(f"a gap of more than {_MAX_VARINT_BYTES} varint bytes")
    low = (spelled & 0x7F).astype(np.int64)
    out = low[starts]
    for digit in range(1, widest):  # one gather per varint byte, never one index per byte
        longer = lengths > digit
        out[longer] += low[starts[longer] + digit] << (7 * digit)
    return out
