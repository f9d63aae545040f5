"""Numba kernels of the delta codec, batched over a space's pages and a version's blobs: encode.py's bytes, checks.

runtime/delta/encode.py's per-page reference stays the specification (and names the error of a refused blob): these
kernels write the same blobs and refuse the same ones. Encoding ids, header layout and the choice between encodings
are encode.py's; a kernel that refuses a blob returns its number and leaves the message to encode.decode.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Encoding ids as encode.Encoding spells them (numba kernels take plain integers).
RAW, BITMASK, INDICES, GAPS = 1, 2, 3, 4
_HEADER = 8
_MAX_VARINT_BYTES = 5


@njit(cache=True, nogil=True, inline="always")
def _varint_len(value):
    n = 1
    while value >= 0x80:
        value >>= 7
        n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _header(out, at, encoding, log2_unit, count):
    out[at] = encoding
    out[at + 1] = log2_unit
    out[at + 2] = 0
    out[at + 3] = 0
    for b in range(4):
        out[at + 4 + b] = (count >> (8 * b)) & 0xFF


@njit(cache=True, nogil=True)
def encode_pages(cur, cur_bytes, unit, prev, page_start, page_units, out, used, capacity, fits, ends, rows, scratch, kinds):
    """Diff, encode and keep the pages of one space, in order.

    cur: the space's units of `unit` bytes as served (cur_bytes: the same memory as bytes); prev: the previous units of these pages,
    back to back; page_start / page_units: each page's first unit in `cur` and its unit count; rows: each page's row
    (its slot of `ends`). While `fits`, each changed page's blob (encode.encode's bytes) is appended to `out` at
    `used` unless it would pass `capacity`, after which nothing more is written. ends[row] = `used` after the page;
    kinds[encoding] counts the blobs written. `prev` is updated to `cur`. Returns (used, fits, changed units).
    """
    log2_unit = 0 if unit == 1 else (1 if unit == 2 else (2 if unit == 4 else 3))
    at_prev = 0
    total_changed = 0
    for p in range(page_start.size):
        s, n = page_start[p], page_units[p]
        k = 0
        for j in range(n):
            c = cur[s + j]
            if c != prev[at_prev + j]:
                scratch[k] = j
                k += 1
                prev[at_prev + j] = c
        at_prev += n
        total_changed += k
        if fits and k:
            body = _HEADER + k * unit
            isz = 2 if n <= 65536 else 4
            gap_bytes = 0
            last = -1
            for i in range(k):
                gap_bytes += _varint_len(scratch[i] - last - 1)
                last = scratch[i]
            best, size = BITMASK, body + (n + 7) // 8
            if body + k * isz < size:
                best, size = INDICES, body + k * isz
            if body + gap_bytes < size:
                best, size = GAPS, body + gap_bytes
            if size >= n * unit:
                best, size = RAW, _HEADER + n * unit
            if used + size > capacity:
                fits = False
            else:
                o = used
                _header(out, o, best, log2_unit, n if best == RAW else k)
                o += _HEADER
                if best == RAW:
                    base = s * unit
                    for b in range(n * unit):
                        out[o + b] = cur_bytes[base + b]
                else:
                    for i in range(k):
                        base = (s + scratch[i]) * unit
                        for b in range(unit):
                            out[o + b] = cur_bytes[base + b]
                        o += unit
                    if best == BITMASK:
                        for b in range((n + 7) // 8):
                            out[o + b] = 0
                        for i in range(k):
                            out[o + (scratch[i] >> 3)] |= np.uint8(1 << (scratch[i] & 7))
                    elif best == INDICES:
                        for i in range(k):
                            for b in range(isz):
                                out[o + b] = (scratch[i] >> (8 * b)) & 0xFF
                            o += isz
                    else:
                        last = -1
                        for i in range(k):
                            g = scratch[i] - last - 1
                            last = scratch[i]
                            while g >= 0x80:
                                out[o] = (g & 0x7F) | 0x80
                                g >>= 7
                                o += 1
                            out[o] = g
                            o += 1
                used += size
                kinds[best] += 1
        ends[rows[p]] = used
    return used, fits, total_changed


@njit(cache=True, nogil=True, inline="always")
def _copy_values(staged, at, count, unit, values, w):
    """values[w:w + count] = the `count` little-endian units of `unit` bytes at staged[at:]."""
    if unit == 2:
        for j in range(count):
            values[w + j] = np.uint64(staged[at + 2 * j]) | (np.uint64(staged[at + 2 * j + 1]) << np.uint64(8))
    elif unit == 1:
        for j in range(count):
            values[w + j] = staged[at + j]
    else:
        for j in range(count):
            value = np.uint64(0)
            for b in range(unit):
                value |= np.uint64(staged[at + j * unit + b]) << np.uint64(8 * b)
            values[w + j] = value


@njit(cache=True, nogil=True)
def count_changes(staged, start, length, n_units, unit):
    """Check every blob's header against its page (encode.decode's first checks) and count the changes they hold.
    Returns (first refused blob or -1, total changes)."""
    total = 0
    for i in range(start.size):
        a, m, n, u = start[i], length[i], n_units[i], unit[i]
        if m == 0:
            continue
        if m < _HEADER:
            return i, 0
        encoding = staged[a]
        if encoding < RAW or encoding > GAPS or staged[a + 1] > 3 or (1 << staged[a + 1]) != u:
            return i, 0
        count = 0
        for b in range(4):
            count |= np.int64(staged[a + 4 + b]) << (8 * b)
        if count > n or (encoding == RAW and count != n) or m < _HEADER + count * u:
            return i, 0
        total += count
    return -1, total


@njit(cache=True, nogil=True)
def decode_blobs(staged, start, length, n_units, unit, key_base, keys, values):
    """Decode every blob (headers already checked by count_changes) into `keys` (key_base[i] + unit * position: the
    change's byte in its space's key range) and `values` (its unit's bytes as a little-endian integer), in blob order.
    Returns the first refused blob or -1; nothing after a refused blob is meaningful."""
    w = 0
    for i in range(start.size):
        a, m, n, u = start[i], length[i], n_units[i], unit[i]
        if m == 0:
            continue
        encoding = staged[a]
        count = 0
        for b in range(4):
            count |= np.int64(staged[a + 4 + b]) << (8 * b)
        v = a + _HEADER
        spelled = v + count * u
        spelled_bytes = a + m - spelled
        if encoding == RAW:
            if spelled_bytes:
                return i
            for j in range(n):
                keys[w + j] = key_base[i] + u * j
        elif encoding == BITMASK:
            if spelled_bytes != (n + 7) // 8:
                return i
            ones = 0
            for b in range(spelled_bytes):
                byte = staged[spelled + b]
                if b == spelled_bytes - 1 and n % 8 and byte >> (n % 8):
                    return i  # bits beyond the page
                while byte:
                    ones += 1
                    byte &= byte - 1
            if ones != count:
                return i
            j = w
            for b in range(spelled_bytes):
                byte = staged[spelled + b]
                bit = 0
                while byte:
                    if byte & 1:
                        keys[j] = key_base[i] + u * (8 * b + bit)
                        j += 1
                    byte >>= 1
                    bit += 1
        elif encoding == INDICES:
            isz = 2 if n <= 65536 else 4
            if spelled_bytes != count * isz:
                return i
            last = -1
            for j in range(count):
                position = 0
                for b in range(isz):
                    position |= np.int64(staged[spelled + j * isz + b]) << (8 * b)
                if position <= last or position >= n:
                    return i
                last = position
                keys[w + j] = key_base[i] + u * position
        else:
            # encode.decode's checks: as many terminating bytes (< 0x80) as changes, the last byte one of them (then
            # no varint runs past the blob), none longer than 5 bytes, the last position within the page
            end = a + m
            ends = 0
            for o in range(spelled, end):
                ends += staged[o] < 0x80
            if ends != count or (count and staged[end - 1] >= 0x80) or (not count and end > spelled):
                return i
            base = key_base[i]
            o = spelled
            position = -1
            for j in range(count):
                byte = staged[o]
                o += 1
                g = np.int64(byte & 0x7F)
                shift = 7
                while byte >= 0x80:
                    if shift >= 7 * _MAX_VARINT_BYTES:
                        return i
                    byte = staged[o]
                    o += 1
                    g |= np.int64(byte & 0x7F) << shift
                    shift += 7
                position += g + 1
                keys[w + j] = base + u * position
            if count and position >= n:
                return i
        _copy_values(staged, v, count, u, values, w)
        w += count
    return -1


@njit(cache=True, nogil=True)
def scatter(destinations, keys, values, unit, lo, hi, target_key, target_entry, target_dst):
    """Write changes lo[t]:hi[t] of every target t into entry target_entry[t] (a uint8 array of `destinations`) at
    target_dst[t] + (key - target_key[t]), `unit[t]` bytes each, little-endian. Returns the units written."""
    written = 0
    for t in range(lo.size):
        dest = destinations[target_entry[t]]
        u = unit[t]
        shift = target_dst[t] - target_key[t]
        if u == 2:
            for i in range(lo[t], hi[t]):
                at = shift + keys[i]
                value = values[i]
                dest[at] = value & np.uint64(0xFF)
                dest[at + 1] = (value >> np.uint64(8)) & np.uint64(0xFF)
        else:
            for i in range(lo[t], hi[t]):
                at = shift + keys[i]
                value = values[i]
                for b in range(u):
                    dest[at + b] = (value >> np.uint64(8 * b)) & np.uint64(0xFF)
        written += hi[t] - lo[t]
    return written
