"""Delta encoding (runtime/delta/encode.py, the per-page reference; runtime/delta/kernels.py, batched) and its mapping
to destinations (runtime/delta/pages.py, apply.py): round trips for random densities, units and encodings; the
batched encoder writes the reference's blobs; applying a batched delta through strided READ descriptors cut at
arbitrary page and shard boundaries equals writing the new bytes in full; malformed blobs are refused in one line,
by the batched decoder exactly where and as the reference refuses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from weightplan.runtime.delta import kernels
from weightplan.runtime.delta.apply import (RefusedBlob, apply_writes, decode_all, destination_list, keyed_targets,
                                            page_keys, writes_of)
from weightplan.runtime.delta.encode import (HEADER_BYTES, UNIT_DTYPES, DeltaError, Encoding, apply, changed, choose,
                                             decode, encode, encoded_sizes)
from weightplan.runtime.delta.pages import PAGE_BYTES, Pages, Space, needed_pages, targets
from weightplan.runtime.tables.ranks import RemoteRegion, row_pieces

_UNITS = st.sampled_from([1, 2, 4])  # fp8 bytes, bf16, fp32 (and scales)


def _page(seed: int, n: int, unit: int, density: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    previous = rng.integers(0, 256, n * unit, dtype=np.uint8).view(UNIT_DTYPES[unit])
    current = previous.copy()
    flip = rng.random(n) < density
    current[flip] ^= rng.integers(1, 255, int(flip.sum())).astype(current.dtype)  # always a different value
    return previous, current


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 70000), unit=_UNITS, density=st.sampled_from([0, 1e-4, 0.01, 0.03, 0.3, 1.0]),
       forced=st.sampled_from([None, *Encoding]))
@example(seed=0, n=65536, unit=1, density=1.0, forced=Encoding.INDICES)  # indices of the last unit of a full fp8 page
def test_every_encoding_round_trips(seed, n, unit, density, forced):
    previous, current = _page(seed, n, unit, density)
    positions = changed(previous, current)
    if forced is not None and forced is not Encoding.RAW and not len(positions):
        forced = None
    blob = encode(current, positions, forced)
    assert len(blob) == (0 if forced is None and not len(positions) else
                         encoded_sizes(n, unit, positions)[forced or choose(n, unit, positions)])
    target = previous.copy()
    apply(target, decode(blob, n, unit))
    assert np.array_equal(target, current)
    if forced is None and len(positions):  # the chosen encoding is never larger than the page plus its header
        assert len(blob) <= HEADER_BYTES + n * unit


def test_the_choice_follows_density():
    n = PAGE_BYTES // 2
    for density, expected in ((1e-3, Encoding.GAPS), (0.02, Encoding.GAPS), (0.3, Encoding.BITMASK), (1.0, Encoding.RAW)):
        previous, current = _page(1, n, 2, density)
        assert choose(n, 2, changed(previous, current)) is expected, density
    assert choose(n, 2, np.zeros(0, dtype=np.int64)) is None


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b[:5], "shorter than its 8-byte header"),
    (lambda b: np.concatenate([[9], b[1:]]).astype(np.uint8), "unknown page delta encoding 9"),
    (lambda b: np.concatenate([b[:1], [2], b[2:]]).astype(np.uint8), "4-byte units for a page of 2-byte units"),
    (lambda b: np.concatenate([b[:4], np.frombuffer(np.uint32(10**6).tobytes(), np.uint8), b[8:]]), "1000000 changed units for a page of 1000"),
    (lambda b: b[:-1], "bytes of indices for 3 changed units"),
    (lambda b: np.concatenate([b[:-2], np.frombuffer(np.uint16(1000).tobytes(), np.uint8)]), "indices not increasing within"),
])
def test_malformed_blobs_are_refused_in_one_line(mutate, message):
    current = np.arange(1000, dtype=np.uint16)
    blob = encode(current, np.array([3, 70, 999]), Encoding.INDICES)
    with pytest.raises(DeltaError, match=message):
        decode(mutate(blob), 1000, 2)
    _refused_alike([mutate(blob)], 1000, 2)


def _refused_alike(blobs: list[np.ndarray], n: int, unit: int) -> None:
    """The batched decoder refuses these blobs (pages of `n` units) at the first page, and with the message, the
    reference refuses; when the reference takes them all, it decodes the same changes."""
    lengths = np.array([len(b) for b in blobs], dtype=np.int64)
    staged = np.concatenate([np.asarray(b, dtype=np.uint8) for b in blobs])
    rows = np.arange(len(blobs), dtype=np.int64)
    pages = Pages(np.zeros(len(blobs), np.int64), np.zeros(len(blobs), np.int64), rows * n * unit, np.full(len(blobs), n * unit),
                  np.full(len(blobs), unit))
    expected = None
    decoded = []
    for i, b in enumerate(blobs):
        try:
            decoded.append(decode(np.asarray(b, dtype=np.uint8), n, unit))
        except DeltaError as exc:
            expected = (i, str(exc))
            break
    if expected is None:
        changes = decode_all(staged, np.cumsum(lengths) - lengths, lengths, rows, pages, page_keys(pages))
        keys = [pages.start[i] + unit * (np.arange(n) if d.positions is None else d.positions)
                for i, d in enumerate(decoded) if d is not None]
        assert np.array_equal(changes.keys, np.concatenate(keys or [np.zeros(0, np.int64)]))
        assert np.array_equal(changes.values, np.concatenate([d.values for d in decoded if d is not None] or [np.zeros(0, np.uint8)]))
        return
    with pytest.raises(RefusedBlob) as refused:
        decode_all(staged, np.cumsum(lengths) - lengths, lengths, rows, pages, page_keys(pages))
    assert (refused.value.row, str(refused.value)) == expected


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), unit=_UNITS, n=st.sampled_from([9, 300, 4096]), density=st.sampled_from([0.005, 0.05, 0.5, 1.0]),
       forced=st.sampled_from(list(Encoding)), flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
       cut=st.integers(-3, 3))
def test_the_batched_decoder_refuses_exactly_what_the_reference_refuses(seed, unit, n, density, forced, flips, cut):
    blobs = []
    for page in range(3):
        previous, current = _page(seed + page, n, unit, density)
        positions = changed(previous, current)
        blobs.append(encode(current, positions, forced if len(positions) or forced is Encoding.RAW else None).copy())
    target = max(range(3), key=lambda i: len(blobs[i]))
    blob = blobs[target]
    for at, value in flips:
        if len(blob):
            blob[at % len(blob)] = value
    blobs[target] = blob[: max(len(blob) + cut, 0)] if cut < 0 else np.concatenate([blob, np.full(cut, 0x7F, np.uint8)])
    _refused_alike([b for b in blobs if len(b)] or [np.zeros(0, np.uint8)], n, unit)


def test_malformed_gaps_and_bitmasks_are_refused():
    current = np.arange(1000, dtype=np.uint16)
    gaps = encode(current, np.array([3, 70, 999]), Encoding.GAPS)
    with pytest.raises(DeltaError, match=r"gaps reach unit \d+ of a page of 1000"):
        decode(np.concatenate([gaps[:-1], [gaps[-1] + 1]]).astype(np.uint8), 1000, 2)
    with pytest.raises(DeltaError, match="do not spell 3 varints"):
        decode(np.concatenate([gaps, [0x80]]).astype(np.uint8), 1000, 2)
    _refused_alike([np.concatenate([gaps[:-1], [gaps[-1] + 1]]).astype(np.uint8)], 1000, 2)
    _refused_alike([gaps, np.concatenate([gaps, [0x80]]).astype(np.uint8)], 1000, 2)
    for encoding in Encoding:  # a header of no changes: nothing may follow it (but a bitmask's bytes)
        for tail in ([], [0x80], [0, 0]):
            _refused_alike([np.array([int(encoding), 1, 0, 0, 0, 0, 0, 0, *tail], dtype=np.uint8)], 9, 2)
    bits = encode(current[:999], np.array([3, 70]), Encoding.BITMASK)
    _refused_alike([bits, np.concatenate([bits[:-1], [bits[-1] | 0x80]]).astype(np.uint8)], 999, 2)
    _refused_alike([np.concatenate([bits[:-2], [bits[-2] | 1], bits[-1:]]).astype(np.uint8)], 999, 2)
    with pytest.raises(DeltaError, match="marks units beyond the page's 999"):
        decode(np.concatenate([bits[:-1], [bits[-1] | 0x80]]).astype(np.uint8), 999, 2)
    with pytest.raises(DeltaError, match="says 2 changed units, its positions give 3"):
        decode(np.concatenate([bits[:-2], [bits[-2] | 1], bits[-1:]]).astype(np.uint8), 999, 2)


@st.composite
def _layouts(draw):
    """One page space of random bytes and READ descriptors into 1-4 destination entries: strided runs expanded to rows
    (as runtime/tables/receiver.py posts them), two entries reading the same bytes, runs cut at arbitrary offsets."""
    unit = draw(_UNITS)
    space_units = draw(st.integers(1, 3 * PAGE_BYTES // unit))
    n_entries = draw(st.integers(1, 4))
    runs = []
    for e in range(n_entries):
        size = draw(st.integers(1, 4000))
        filled = 0
        while filled < size:
            count = draw(st.integers(1, 5))
            length = draw(st.integers(1, max(1, min(size - filled, space_units) // count)))
            stride = draw(st.integers(length, max(length, space_units // count)))
            if (count - 1) * stride + length > space_units or filled + count * length > size:
                count, stride = 1, length
                length = min(length, size - filled, space_units)
            start = draw(st.integers(0, space_units - ((count - 1) * stride + length)))
            runs.append((e, start, filled, length, count, stride))
            filled += count * length
    sizes = np.zeros(n_entries, dtype=np.int64)
    for e, _, filled, length, count, _ in runs:
        sizes[e] = max(sizes[e], filled + count * length)
    return unit, space_units, runs, sizes


def _encode_batched(previous: np.ndarray, current: np.ndarray, pages: Pages, capacity: int | None):
    """kernels.encode_pages over one space of `pages` (publish's call): (region bytes used, ends, kinds, fits); checks
    that `previous` (a copy) became `current`."""
    unit = current.dtype.itemsize
    old = previous.copy()
    region = np.zeros(2 * current.nbytes + 64 * len(pages), dtype=np.uint8)
    ends, kinds = np.zeros(len(pages), dtype=np.int64), np.zeros(max(Encoding) + 1, dtype=np.int64)
    rows = np.arange(len(pages), dtype=np.int64)
    used, fits, k = kernels.encode_pages(current, current.view(np.uint8), unit, old, pages.start // unit, pages.nbytes // unit,
                                         region, 0, len(region) if capacity is None else capacity, True, ends, rows,
                                         np.empty(max(int(pages.nbytes.max()) // unit, 1), dtype=np.int64), kinds)
    assert np.array_equal(old, current) and k == len(changed(previous, current))
    return region[:used], ends, kinds, fits


def _space_pages(units: int, unit: int, page_units: int) -> Pages:
    starts = np.arange(0, units, page_units) * unit
    return Pages(np.zeros(len(starts), np.int64), np.zeros(len(starts), np.int64), starts,
                 np.minimum(starts + page_units * unit, units * unit) - starts, np.full(len(starts), unit))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), unit=_UNITS, page_units=st.sampled_from([1, 7, 4096, PAGE_BYTES // 2, 65536, 70000]),
       n_pages=st.integers(1, 6), density=st.sampled_from([0, 1e-4, 0.01, 0.02, 0.1, 0.3, 0.9, 1.0]),
       last=st.integers(1, 70000), capacity=st.one_of(st.none(), st.integers(0, 50000)))
def test_the_batched_encoder_writes_the_reference_blobs(seed, unit, page_units, n_pages, density, last, capacity):
    units = page_units * (n_pages - 1) + min(last, page_units)  # the last page of a space may be short
    previous, current = _page(seed, units, unit, density)
    pages = _space_pages(units, unit, page_units)
    blobs, ends, kinds, fits = _encode_batched(previous, current, pages, capacity)
    reference, expected_ends, used, expected_fits = [], [], 0, True
    for start, nbytes in zip((pages.start // unit).tolist(), (pages.nbytes // unit).tolist()):
        blob = encode(current[start : start + nbytes], changed(previous[start : start + nbytes], current[start : start + nbytes]))
        if expected_fits and len(blob):
            if capacity is not None and used + len(blob) > capacity:
                expected_fits = False
            else:
                reference.append(blob)
                used += len(blob)
        expected_ends.append(used)
    assert fits == expected_fits and ends.tolist() == expected_ends
    assert np.array_equal(blobs, np.concatenate(reference or [np.zeros(0, np.uint8)]))
    assert int(kinds.sum()) == len(reference) and all(kinds[int(b[0])] >= 1 for b in reference)


@settings(max_examples=40, deadline=None)
@given(layout=_layouts(), seed=st.integers(0, 2**31), density=st.sampled_from([0.001, 0.02, 0.5, 1.0]))
def test_a_delta_applied_through_descriptors_equals_writing_the_new_bytes_in_full(layout, seed, density):
    unit, space_units, runs, sizes = layout
    previous, current = _page(seed, space_units, unit, density)
    e, src, dst, length, count, stride = (np.array(c, dtype=np.int64) for c in zip(*runs))
    # every row a descriptor (count rows, src `stride` apart, dst contiguous), in bytes
    run, nbytes, (remote, local_off) = row_pieces(count, length * unit, np.zeros(len(e), bool),
                                                  (src * unit, stride * unit), (dst * unit, length * unit))
    bases = np.cumsum(sizes * unit + 64) - sizes * unit  # entries at distinct "addresses"
    local = bases[e[run]] + local_off
    region = np.zeros(len(run), dtype=np.int64)
    deltable, found = targets(region, remote, nbytes, local, np.full(len(run), -1), bases, sizes * unit)
    assert deltable.all()
    starts = np.arange(0, space_units * unit, PAGE_BYTES)
    pages = Pages(np.zeros(len(starts), np.int64), np.zeros(len(starts), np.int64), starts,
                  np.minimum(starts + PAGE_BYTES, space_units * unit) - starts, np.full(len(starts), unit))

    def land(space: np.ndarray) -> list[np.ndarray]:
        out = [np.zeros(int(s) * unit, dtype=np.uint8) for s in sizes]
        raw = space.view(np.uint8)
        for i in range(len(run)):
            out[int(e[run[i]])][local_off[i] : local_off[i] + nbytes[i]] = raw[remote[i] : remote[i] + nbytes[i]]
        return out

    landed, expected = land(previous), land(current)
    need = needed_pages(pages, found)
    blobs, ends, _, _ = _encode_batched(previous, current, pages, capacity=None)
    rows = np.flatnonzero(need & (np.diff(ends, prepend=0) > 0))
    begin = np.concatenate([[0], ends[:-1]])
    changes = decode_all(blobs, begin[rows], ends[rows] - begin[rows], rows, pages, page_keys(pages))
    reference = [decode(blobs[begin[r] : ends[r]], int(pages.nbytes[r]) // unit, unit) for r in rows.tolist()]
    assert np.array_equal(changes.values, np.concatenate([d.values for d in reference] or [np.zeros(0, np.uint64)]))
    writes = writes_of(changes, keyed_targets(pages, found), sizes * unit)
    assert apply_writes(writes, destination_list(dict(enumerate(landed)), len(landed))) == writes.units
    assert all(np.array_equal(a, b) for a, b in zip(landed, expected))
    # a page no descriptor reads is never needed
    touched = np.zeros(len(pages), bool)
    for i in range(len(run)):
        touched[int(remote[i]) // PAGE_BYTES : (int(remote[i] + nbytes[i]) - 1) // PAGE_BYTES + 1] = True
    assert np.array_equal(need, touched)


def test_staging_slot_reads_and_stage_copies_are_never_in_a_delta():
    bases, sizes = np.array([1000, -1]), np.array([100, 0])
    region = np.array([0, RemoteRegion.STAGE_PACKED, RemoteRegion.FP8, 0])
    local = np.array([1000, 1010, 1050, 5000])  # the last lands outside every destination: a staging slot
    deltable, found = targets(region, np.array([0, 0, 8, 64]), np.array([8, 8, 8, 8]), local, np.full(4, -1), bases, sizes)
    assert deltable.tolist() == [True, False, True, False]
    assert found.space.tolist() == [Space.REGION, Space.FP8] and found.dst_byte.tolist() == [0, 50]


def test_values_are_bit_copies_for_every_wire_dtype():
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        x = torch.randn(4096).to(dtype)
        y = x.clone()
        y[::97] = torch.tensor(float("nan")).to(dtype) if dtype != torch.float8_e4m3fn else torch.tensor(-0.0).to(dtype)
        unit = x.element_size()
        a, b = x.view(torch.uint8).numpy().view(UNIT_DTYPES[unit]), y.view(torch.uint8).numpy().view(UNIT_DTYPES[unit])
        target = a.copy()
        apply(target, decode(encode(b, changed(a, b)), len(b), unit))
        assert np.array_equal(target, b)
