"""Triton kernels of the delta codec on device tensors: kernels.py's (numba) blobs, decodes and scatters, bit for bit.

Imported only by runtime/delta/device.py, which prepares their arguments; with TRITON_INTERPRET=1 (set before triton
is imported) the same kernels run on CPU tensors, which is how tests/runtime/test_delta_triton.py proves them here.
Encoding ids and header layout are encode.py's. One program per page (encode) or per blob (decode); a page is walked
in blocks of BLOCK units, carrying the count of changed units, the last changed position and the varint bytes so far.
"""

from __future__ import annotations

import triton
import triton.language as tl

RAW, BITMASK, INDICES, GAPS = 1, 2, 3, 4  # as encode.Encoding


@triton.jit
def _last_two(last_a, before_a, last_b, before_b):
    # A scan of (last changed position, the changed position before it) over a block, -1 for none: the second
    # component at a changed unit is the previous changed unit, so no program reads a neighbour's memory.
    has = last_b >= 0
    return tl.where(has, last_b, last_a), tl.where(has, tl.where(before_b >= 0, before_b, last_a), before_a)


@triton.jit
def _varint_len(g):
    return 1 + (g >= 0x80).to(tl.int64) + (g >= 1 << 14).to(tl.int64) + (g >= 1 << 21).to(tl.int64) \
        + (g >= 1 << 28).to(tl.int64)


@triton.jit
def _changes(cur_ptr, prev_ptr, s, pa, j, n, last):
    """Changed mask of units j of the page at cur[s:], prev[pa:], their current units, and each changed unit's gap
    since the previous changed unit (`last`: the last changed unit before the block)."""
    inside = j < n
    c = tl.load(cur_ptr + s + j, mask=inside, other=0)
    p = tl.load(prev_ptr + pa + j, mask=inside, other=0)
    m = (c != p) & inside
    at = tl.where(m, j, -1)
    _, before = tl.associative_scan((at, tl.full(at.shape, -1, tl.int64)), 0, _last_two)
    before = tl.where(before >= 0, before, last)
    return m, c, j - before - 1


@triton.jit
def diff_stats(cur_ptr, prev_ptr, page_start, page_units, prev_at, rows, count_out, gap_bytes_out,
               BLOCK: tl.constexpr):
    """Per page: its changed units and the LEB128 bytes of their gaps (what encode.choose needs)."""
    p = tl.program_id(0)
    s = tl.load(page_start + p)
    n = tl.load(page_units + p)
    pa = tl.load(prev_at + p)
    row = tl.load(rows + p)
    k = tl.zeros((), tl.int64)
    gb = tl.zeros((), tl.int64)
    last = tl.full((), -1, tl.int64)
    for b0 in tl.range(0, n, BLOCK):
        j = b0 + tl.arange(0, BLOCK).to(tl.int64)
        m, _, gap = _changes(cur_ptr, prev_ptr, s, pa, j, n, last)
        k += tl.sum(m.to(tl.int64))
        gb += tl.sum(tl.where(m, _varint_len(gap), 0))
        last = tl.maximum(last, tl.max(tl.where(m, j, -1)))
    tl.store(count_out + row, k)
    tl.store(gap_bytes_out + row, gb)


@triton.jit
def _store_unit(out_ptr, at, value, mask, UNIT: tl.constexpr):
    for b in tl.static_range(UNIT):
        tl.store(out_ptr + at + b, ((value >> (8 * b)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def encode_write(cur_ptr, prev_ptr, page_start, page_units, prev_at, rows, encoding, count, offset, out_ptr,
                 UNIT: tl.constexpr, LOG2_UNIT: tl.constexpr, BLOCK: tl.constexpr):
    """Per page: its blob (encoding[row], 0: none) at out[offset[row]:], then prev = cur over the page."""
    p = tl.program_id(0)
    s = tl.load(page_start + p)
    n = tl.load(page_units + p)
    pa = tl.load(prev_at + p)
    row = tl.load(rows + p)
    enc = tl.load(encoding + row)
    k = tl.load(count + row)
    o = tl.load(offset + row)
    if enc != 0:
        header = tl.arange(0, 8)
        spelled_count = tl.where(enc == RAW, n, k)
        byte = tl.where(header == 0, enc, tl.where(header == 1, LOG2_UNIT, tl.where(
            header >= 4, (spelled_count >> (8 * tl.maximum(header - 4, 0))) & 0xFF, 0)))
        tl.store(out_ptr + o + header, byte.to(tl.uint8))
    spelled = o + 8 + k * UNIT
    isz = tl.where(n <= 65536, 2, 4)
    done = tl.zeros((), tl.int64)
    last = tl.full((), -1, tl.int64)
    gaps_at = tl.zeros((), tl.int64)
    for b0 in tl.range(0, n, BLOCK):
        j = b0 + tl.arange(0, BLOCK).to(tl.int64)
        m, c, gap = _changes(cur_ptr, prev_ptr, s, pa, j, n, last)
        mi = m.to(tl.int64)
        rank = done + tl.cumsum(mi, 0) - 1
        if enc == RAW:
            _store_unit(out_ptr, o + 8 + j * UNIT, c, j < n, UNIT)
        elif enc != 0:
            _store_unit(out_ptr, o + 8 + rank * UNIT, c, m, UNIT)
            if enc == BITMASK:
                bits = tl.reshape(mi, (BLOCK // 8, 8))
                byte = tl.sum(bits << tl.arange(0, 8).to(tl.int64)[None, :], 1)
                bj = b0 // 8 + tl.arange(0, BLOCK // 8)
                tl.store(out_ptr + spelled + bj, byte.to(tl.uint8), mask=bj < (n + 7) // 8)
            elif enc == INDICES:
                for b in tl.static_range(4):
                    tl.store(out_ptr + spelled + rank * isz + b, ((j >> (8 * b)) & 0xFF).to(tl.uint8), mask=m & (tl.full(m.shape, b, tl.int32) < isz))
            else:
                length = tl.where(m, _varint_len(gap), 0)
                at = spelled + gaps_at + tl.cumsum(length, 0) - length
                for d in tl.static_range(5):
                    digit = ((gap >> (7 * d)) & 0x7F) | tl.where(length > d + 1, 0x80, 0)
                    tl.store(out_ptr + at + d, digit.to(tl.uint8), mask=m & (length > d))
                gaps_at += tl.sum(length)
        tl.store(prev_ptr + pa + j, c, mask=j < n)
        done += tl.sum(mi)
        last = tl.maximum(last, tl.max(tl.where(m, j, -1)))


@triton.jit
def _load_le(ptr, at, mask, width):
    """The little-endian integers of `width` (<= 8) bytes at ptr[at:]."""
    value = tl.zeros(at.shape, tl.int64)
    for b in tl.static_range(8):
        byte = tl.load(ptr + at + b, mask=mask & (tl.full(at.shape, b, tl.int64) < width), other=0).to(tl.int64)
        value |= byte << (8 * b)
    return value


@triton.jit
def decode_blobs(staged, start, length, n_units, unit, key_base, first, keys, values, refused, BLOCK: tl.constexpr):
    """Per blob whose header count_changes-style checks passed (device.py): its changes' keys (key_base + unit *
    position) and values at keys[first:], values[first:]; refused[blob] = 1 for a blob kernels.decode_blobs refuses
    (then nothing it wrote is meaningful)."""
    i = tl.program_id(0)
    a = tl.load(start + i)
    m = tl.load(length + i)
    n = tl.load(n_units + i)
    u = tl.load(unit + i)
    kb = tl.load(key_base + i)
    w = tl.load(first + i)
    if m > 0:
        enc = tl.load(staged + a).to(tl.int64)
        count = _load_le(staged, a + 4 + tl.arange(0, 1).to(tl.int64), tl.full((1,), True, tl.int1), 4)
        count = tl.sum(count)
        v = a + 8
        spelled = v + count * u
        spelled_bytes = a + m - spelled
        bad = tl.zeros((), tl.int1)
        if enc == RAW:
            bad = spelled_bytes != 0
            for b0 in tl.range(0, n, BLOCK):
                j = b0 + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(keys + w + j, kb + u * j, mask=j < n)
        elif enc == BITMASK:
            nb = (n + 7) // 8
            bad = spelled_bytes != nb
            if bad == 0:
                ones = tl.zeros((), tl.int64)
                beyond = tl.zeros((), tl.int64)
                for b0 in tl.range(0, nb, BLOCK):
                    bj = b0 + tl.arange(0, BLOCK).to(tl.int64)
                    byte = tl.load(staged + spelled + bj, mask=bj < nb, other=0).to(tl.int64)
                    bits = (byte[:, None] >> tl.arange(0, 8).to(tl.int64)[None, :]) & 1
                    position = bj[:, None] * 8 + tl.arange(0, 8).to(tl.int64)[None, :]
                    ones += tl.sum(tl.sum(bits, 1))
                    beyond += tl.sum(tl.sum(tl.where(position >= n, bits, 0), 1))
                bad = (ones != count) | (beyond != 0)
                if bad == 0:
                    done = tl.zeros((), tl.int64)
                    for b0 in tl.range(0, nb, BLOCK // 8):
                        bj = b0 + tl.arange(0, BLOCK // 8).to(tl.int64)
                        byte = tl.load(staged + spelled + bj, mask=bj < nb, other=0).to(tl.int64)
                        bits = tl.reshape((byte[:, None] >> tl.arange(0, 8).to(tl.int64)[None, :]) & 1, (BLOCK,))
                        position = b0 * 8 + tl.arange(0, BLOCK).to(tl.int64)
                        rank = done + tl.cumsum(bits, 0) - 1
                        tl.store(keys + w + rank, kb + u * position, mask=bits != 0)
                        done += tl.sum(bits)
        elif enc == INDICES:
            isz = tl.where(n <= 65536, 2, 4)
            bad = spelled_bytes != count * isz
            if bad == 0:
                wrong = tl.zeros((), tl.int64)
                for b0 in tl.range(0, count, BLOCK):
                    j = b0 + tl.arange(0, BLOCK).to(tl.int64)
                    inside = j < count
                    position = _load_le(staged, spelled + j * isz, inside, isz)
                    before = _load_le(staged, spelled + (j - 1) * isz, inside & (j > 0), isz)
                    before = tl.where(j > 0, before, -1)
                    wrong += tl.sum((inside & ((position <= before) | (position >= n))).to(tl.int64))
                    tl.store(keys + w + j, kb + u * position, mask=inside)
                bad = wrong != 0
        else:
            # kernels.decode_blobs' checks: as many terminating bytes (< 0x80) as changes, the last byte one of them,
            # no varint longer than 5 bytes, the last position within the page
            ends = tl.zeros((), tl.int64)
            long = tl.zeros((), tl.int64)
            for b0 in tl.range(0, spelled_bytes, BLOCK):
                o = b0 + tl.arange(0, BLOCK).to(tl.int64)
                inside = o < spelled_bytes
                byte = tl.load(staged + spelled + o, mask=inside, other=0)
                term = inside & (byte < 0x80)
                ends += tl.sum(term.to(tl.int64))
                run = tl.full(o.shape, 1, tl.int1)
                for d in tl.static_range(1, 6):
                    back = tl.load(staged + spelled + o - d, mask=term & (o - d >= 0), other=0)
                    run = run & (o - d >= 0) & (back >= 0x80)
                long += tl.sum((term & run).to(tl.int64))
            lastbyte = tl.load(staged + a + m - 1, mask=spelled_bytes > 0, other=0)
            bad = (ends != count) | (long != 0) | ((count > 0) & (lastbyte >= 0x80)) | ((count == 0) & (spelled_bytes > 0))
            if bad == 0:
                done = tl.zeros((), tl.int64)
                position = tl.full((), -1, tl.int64)
                for b0 in tl.range(0, spelled_bytes, BLOCK):
                    o = b0 + tl.arange(0, BLOCK).to(tl.int64)
                    term = (o < spelled_bytes) & (tl.load(staged + spelled + o, mask=o < spelled_bytes, other=0xFF) < 0x80)
                    # a varint ends at a terminating byte and starts after the continuation bytes before it (<= 4)
                    length = tl.full(o.shape, 1, tl.int64)
                    going = term
                    for d in tl.static_range(1, 5):
                        back = tl.load(staged + spelled + o - d, mask=going & (o - d >= 0), other=0)
                        going = going & (o - d >= 0) & (back >= 0x80)
                        length += going.to(tl.int64)
                    g = tl.zeros(o.shape, tl.int64)
                    for d in tl.static_range(5):
                        byte = tl.load(staged + spelled + o - d, mask=term & (d < length), other=0).to(tl.int64)
                        g |= tl.where(d < length, (byte & 0x7F) << (7 * (length - 1 - d)), 0)
                    step = tl.where(term, g + 1, 0)
                    at = position + tl.cumsum(step, 0)
                    ti = term.to(tl.int64)
                    rank = done + tl.cumsum(ti, 0) - 1
                    tl.store(keys + w + rank, kb + u * at, mask=term)
                    position += tl.sum(step)
                    done += tl.sum(ti)
                bad = (count > 0) & (position >= n)
        total = tl.where(enc == RAW, n, count)
        for b0 in tl.range(0, total, BLOCK):
            j = b0 + tl.arange(0, BLOCK).to(tl.int64)
            tl.store(values + w + j, _load_le(staged, v + j * u, j < total, u), mask=j < total)
        tl.store(refused + i, bad.to(tl.int32))


@triton.jit
def scatter(keys, values, chunk_target, chunk_first, hi, target_key, target_at, target_unit, base,
            BLOCK: tl.constexpr):
    """Per chunk of a target's changes: each change's `unit` bytes, little-endian, at base + target_at[t] +
    (key - target_key[t]) (target_at: the target's destination byte, relative to `base`)."""
    c = tl.program_id(0)
    t = tl.load(chunk_target + c)
    i = tl.load(chunk_first + c) + tl.arange(0, BLOCK).to(tl.int64)
    inside = i < tl.load(hi + t)
    key = tl.load(keys + i, mask=inside, other=0)
    value = tl.load(values + i, mask=inside, other=0)
    at = tl.load(target_at + t) + key - tl.load(target_key + t)
    u = tl.load(target_unit + t)
    for b in tl.static_range(8):
        tl.store(base + at + b, ((value >> (8 * b)) & 0xFF).to(tl.uint8), mask=inside & (tl.full(i.shape, b, tl.int64) < u))
