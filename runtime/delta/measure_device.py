"""Measure the device delta codec's rates (the Triton kernels) on a GPU, its bytes checked against the host codec.

`measure_delta_device_rates("cuda")` is what a GPU check calls for the cluster file's `delta_encode_gbytes_per_s`
(page bytes diffed and encoded per second) and `delta_apply_gbytes_per_s` (delta bytes decoded and scattered into the
destination per second). Without CUDA it returns {"status": "skipped", "reason": ...}.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch

from .apply import apply_writes as host_apply, decode_all as host_decode, destination_list, keyed_targets, page_keys, writes_of
from .encode import Encoding
from .pages import PAGE_BYTES, Pages, Targets

REPEATS = 5


def measure_delta_device_rates(device: str | torch.device = "cuda", pages: int = 4096, density: float = 0.02,
                               seed: int = 0, repeats: int = REPEATS) -> dict:
    """Best-of-REPEATS rates of encoding `pages` 64 KiB bf16 pages whose units changed with probability `density`, and
    of decoding and applying that delta, on `device`; AssertionError if a byte differs from the numba host codec.
    On a CPU under TRITON_INTERPRET=1 it runs the interpreted kernels (a test of this function, not a rate)."""
    device = torch.device(device)
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    if not interpreted and (device.type != "cuda" or not torch.cuda.is_available()):
        return {"status": "skipped", "reason": f"no CUDA device ({device}; torch.cuda.is_available() is "
                                               f"{torch.cuda.is_available()})"}
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"status": "skipped", "reason": "triton is not installed"}
    from . import device as codec
    from .kernels import encode_pages

    rng = np.random.default_rng(seed)
    n = PAGE_BYTES // 2
    previous = rng.integers(0, 1 << 16, n * pages, dtype=np.uint16)
    current = previous.copy()
    hit = np.flatnonzero(rng.random(len(current)) < density)
    current[hit] ^= rng.integers(1, 1 << 16, len(hit), dtype=np.uint16)
    start = np.arange(pages, dtype=np.int64) * PAGE_BYTES
    p = Pages(np.zeros(pages, np.int64), np.zeros(pages, np.int64), start, np.full(pages, PAGE_BYTES), np.full(pages, 2))
    capacity = PAGE_BYTES * pages + 8 * pages

    out, ends = np.zeros(capacity, np.uint8), np.zeros(pages, np.int64)
    used, _, _ = encode_pages(current, current.view(np.uint8), 2, previous.copy(), start // 2, np.full(pages, n), out, 0,
                              capacity, True, ends, np.arange(pages), np.empty(n, np.int64),
                              np.zeros(max(Encoding) + 1, np.int64))
    host_blobs = out[:used]

    encoder = codec.DeviceEncoder(p, p.spaces(), np.zeros(1, np.int64), device)
    cur = torch.from_numpy(current.view(np.uint8)).to(device)
    prev0 = torch.from_numpy(previous.view(np.uint8)).to(device)
    region = torch.zeros(capacity, dtype=torch.uint8, device=device)
    encode_seconds = []
    for _ in range(repeats + 1):  # the first compiles the kernels
        prev = prev0.clone()
        _synchronize(device)
        began = time.perf_counter()
        encoded = encoder.encode(lambda i: cur, prev, region, capacity, True)
        _synchronize(device)
        encode_seconds.append(time.perf_counter() - began)
    assert encoded.used == used and np.array_equal(encoded.ends, ends), "device delta encode: blob ends differ from the host's"
    assert torch.equal(region[:used].cpu(), torch.from_numpy(host_blobs)), "device delta encode: bytes differ from the host's"
    assert torch.equal(prev, cur), "device delta encode: the previous version was not updated"

    begin = np.concatenate([[0], ends[:-1]])
    rows = np.flatnonzero(ends > begin)
    lengths = ends[rows] - begin[rows]
    keys = page_keys(p)
    found = Targets(p.space, p.index, p.start, p.nbytes, np.zeros(pages, np.int64), p.start)
    keyed = keyed_targets(p, found)
    expected = previous.view(np.uint8).copy()
    host_apply(writes_of(host_decode(host_blobs, begin[rows], lengths, rows, p, keys), keyed, np.array([len(expected)])),
               destination_list({0: expected}, 1))
    assert np.array_equal(expected, current.view(np.uint8)), "host delta apply: not the current bytes"
    keyed_dev = codec.keyed_on(keyed, device)
    entry_bytes, entry_at = torch.tensor([len(expected)], device=device), torch.zeros(1, dtype=torch.int64, device=device)
    apply_seconds = []
    for _ in range(repeats + 1):
        destination = prev0.clone()
        _synchronize(device)
        began = time.perf_counter()
        changes = codec.decode_all(region, begin[rows], lengths, rows, p, keys)
        codec.apply_writes(codec.writes_of(changes, keyed_dev, entry_bytes), destination, entry_at)
        _synchronize(device)
        apply_seconds.append(time.perf_counter() - began)
    assert torch.equal(destination.cpu(), torch.from_numpy(expected)), "device delta apply: bytes differ from the host's"
    encode_s, apply_s = min(encode_seconds[1:]), min(apply_seconds[1:])
    return {"status": "ok", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)", "pages": pages, "density": float(len(hit) / len(current)),
            "page_bytes": PAGE_BYTES * pages, "delta_bytes": int(used), "encode_seconds": encode_s, "apply_seconds": apply_s,
            "delta_encode_gbytes_per_s": PAGE_BYTES * pages / encode_s / 1e9,
            "delta_apply_gbytes_per_s": used / apply_s / 1e9}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
