"""The Triton delta kernels under TRITON_INTERPRET=1 against the numba host codec: run by test_delta_triton.py in a
subprocess (the variable must be set before triton is imported). Exits non-zero on the first difference."""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from weightplan.runtime.delta import apply, device, kernels  # noqa: E402
from weightplan.runtime.delta.encode import Encoding  # noqa: E402
from weightplan.runtime.delta.pages import Pages, Targets  # noqa: E402

device.BLOCK = 64  # pages of a few hundred units cross several blocks: every carry is exercised
DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32}
SETTINGS = settings(max_examples=int(os.environ.get("DELTA_TRITON_EXAMPLES", "12")), deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


def _space(rng, unit, page_bytes, sizes, density):
    """A space of pages of `page_bytes` (the last `sizes[-1]` units short), its previous and current bytes."""
    units = sizes
    starts = np.concatenate([[0], np.cumsum(units)[:-1]]) * unit
    total = int(sum(units)) * unit
    previous = rng.integers(0, 256, total, dtype=np.uint8)
    current = previous.copy()
    hit = np.flatnonzero(rng.random(total // unit) < density)
    for b in range(unit):
        current[hit * unit + b] ^= rng.integers(1, 256, len(hit)).astype(np.uint8) if b == 0 else rng.integers(0, 256, len(hit)).astype(np.uint8)
    k = len(units)
    pages = Pages(np.zeros(k, np.int64), np.zeros(k, np.int64), starts.astype(np.int64),
                  np.asarray(units, np.int64) * unit, np.full(k, unit))
    return pages, previous, current


def _host_encode(pages, previous, current, capacity, fits):
    unit = int(pages.unit[0])
    out = np.zeros(max(capacity, 1), np.uint8)
    ends, kinds = np.zeros(len(pages), np.int64), np.zeros(max(Encoding) + 1, np.int64)
    prev = previous.copy()
    scratch = np.empty(int((pages.nbytes // unit).max()), np.int64)
    used, fits, changed = kernels.encode_pages(current.view(DTYPES[unit]), current, unit, prev.view(DTYPES[unit]),
                                               pages.start // unit, pages.nbytes // unit, out, 0, capacity, fits, ends,
                                               np.arange(len(pages)), scratch, kinds)
    return out[:used], ends, used, fits, changed, kinds, prev


def _device_encode(pages, previous, current, capacity, fits):
    enc = device.DeviceEncoder(pages, pages.spaces(), np.zeros(1, np.int64), torch.device("cpu"))
    out, prev = torch.zeros(max(capacity, 1), dtype=torch.uint8), torch.from_numpy(previous.copy())
    r = enc.encode(lambda i: torch.from_numpy(current), prev, out, capacity, fits)
    return out.numpy()[: r.used], r.ends, r.used, r.fits, r.changed_units, r.kinds, prev.numpy()


units_of = st.sampled_from([1, 2, 4])
densities = st.sampled_from([0.0, 1e-3, 0.01, 0.05, 0.2, 0.5, 1.0])


@SETTINGS
@given(unit=units_of, density=densities, page_units=st.integers(1, 300), last=st.integers(1, 300),
       pages=st.integers(1, 3), room=st.sampled_from([2.0, 0.3, 0.0]), fits=st.sampled_from([True, True, False]),
       seed=st.integers(0, 2**16))
def check_encode(unit, density, page_units, last, pages, room, fits, seed):
    rng = np.random.default_rng(seed)
    p, previous, current = _space(rng, unit, page_units, [page_units] * (pages - 1) + [min(last, page_units)], density)
    capacity = int(room * len(current))
    host = _host_encode(p, previous, current, capacity, fits)
    dev = _device_encode(p, previous, current, capacity, fits)
    for name, a, b in zip(("blobs", "ends", "used", "fits", "changed", "kinds", "previous"), host, dev):
        assert np.array_equal(np.asarray(a), np.asarray(b)), (name, a, b)


@SETTINGS
@given(unit=units_of, density=densities, page_units=st.integers(1, 300), pages=st.integers(1, 3),
       corrupt=st.sampled_from([None, None, "byte", "truncate"]), seed=st.integers(0, 2**16))
def check_decode_and_apply(unit, density, page_units, pages, corrupt, seed):
    rng = np.random.default_rng(seed)
    p, previous, current = _space(rng, unit, page_units, [page_units] * pages, density)
    blobs, ends, used, *_ = _host_encode(p, previous, current, 2 * len(current) + 64, True)
    begin = np.concatenate([[0], ends[:-1]])
    rows = np.flatnonzero(ends > begin)
    start, length = begin[rows], ends[rows] - begin[rows]
    staged = blobs.copy()
    if corrupt == "byte" and used:
        staged[rng.integers(0, used)] ^= np.uint8(rng.integers(1, 256))
    elif corrupt == "truncate" and len(rows):
        length = length.copy()
        length[-1] -= 1
    keys = apply.page_keys(p)
    outcome = []
    for decode_all, where in ((apply.decode_all, staged), (device.decode_all, torch.from_numpy(staged))):
        try:
            changes = decode_all(where, start, length, rows, p, keys)
            outcome.append((np.asarray(changes.keys), np.asarray(changes.values).view(np.uint64)))
        except apply.RefusedBlob as exc:
            outcome.append((exc.row, str(exc)))
    assert type(outcome[0][0]) is type(outcome[1][0]), outcome
    for a, b in zip(*outcome):
        assert np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b, (a, b)
    if corrupt is not None:
        return
    # one target per page into one destination, plus a second target re-reading the first page elsewhere
    nbytes = len(current)
    found = Targets(np.zeros(len(p) + 1, np.int64), np.zeros(len(p) + 1, np.int64),
                    np.concatenate([p.start, p.start[:1]]), np.concatenate([p.nbytes, p.nbytes[:1]]),
                    np.array([0] * len(p) + [1]), np.concatenate([p.start, [0]]))
    keyed = apply.keyed_targets(p, found)
    entry_bytes = np.array([nbytes, int(p.nbytes[0])])
    host_dst = [previous.copy(), previous[: int(p.nbytes[0])].copy()]
    host_changes = apply.decode_all(staged, start, length, rows, p, keys)
    apply.apply_writes(apply.writes_of(host_changes, keyed, entry_bytes), apply.destination_list(dict(enumerate(host_dst)), 2))
    both = torch.from_numpy(np.concatenate([previous, previous[: int(p.nbytes[0])]]))
    dev_changes = device.decode_all(torch.from_numpy(staged), start, length, rows, p, keys)
    writes = device.writes_of(dev_changes, device.keyed_on(keyed, torch.device("cpu")), torch.as_tensor(entry_bytes))
    device.apply_writes(writes, both, torch.tensor([0, nbytes]))
    assert np.array_equal(both.numpy()[:nbytes], host_dst[0]) and np.array_equal(both.numpy()[nbytes:], host_dst[1])
    assert np.array_equal(host_dst[0], current)


def check_a_full_size_page():
    """One 64 KiB page of bf16 units at a few densities (BLOCK as on the GPU)."""
    device.BLOCK, block = 1024, device.BLOCK
    try:
        for density in (0.01,):
            rng = np.random.default_rng(7)
            p, previous, current = _space(rng, 2, 32768, [32768], density)
            host, dev = _host_encode(p, previous, current, 1 << 17, True), _device_encode(p, previous, current, 1 << 17, True)
            assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(host, dev)), density
    finally:
        device.BLOCK = block


if __name__ == "__main__":
    checks = {"encode": check_encode, "decode": check_decode_and_apply, "page": check_a_full_size_page}
    for name in sys.argv[1:] or checks:
        checks[name]()
        print(f"{name}: ok", flush=True)
