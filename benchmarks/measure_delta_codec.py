"""Measure this host's delta encode and apply rates (runtime/delta/encode.py, in numpy) for simulate-plan's cluster files.

Usage: python benchmarks/measure_delta_codec.py [--density D] [--pages N] [--write CLUSTER.json]

Encode: what `Sender.publish` does per 64 KiB bf16 page (runtime/sender/delta.py): diff against the previous
version, encode the changed units, copy the page into the previous version; page bytes per second. Apply: what a
receiver does per blob: decode it and write its units into a page; delta bytes per second. Best of 3, one process
(one core). Both are host-specific and, on a shared machine, worth their order of magnitude only. --write sets
`delta_encode_gbytes_per_s` and `delta_apply_gbytes_per_s` (and their sources) in a cluster file, leaving the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from weightplan.runtime.delta.encode import apply, changed, decode, encode
from weightplan.runtime.delta.pages import PAGE_BYTES


def measure(density: float, pages: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = PAGE_BYTES // 2
    previous = rng.integers(0, 1 << 16, n * pages, dtype=np.uint16)
    current = previous.copy()
    hit = rng.random(n * pages) < density
    current[hit] ^= rng.integers(1, 1 << 16, int(hit.sum())).astype(np.uint16)
    cut = [slice(p * n, (p + 1) * n) for p in range(pages)]
    encode_s, apply_s, blobs = [], [], []
    for _ in range(3):
        old = previous.copy()
        t0 = time.perf_counter()
        blobs = []
        for c in cut:
            blobs.append(encode(current[c], changed(old[c], current[c])))
            old[c] = current[c]
        t1 = time.perf_counter()
        target = previous.copy()
        for c, blob in zip(cut, blobs):
            apply(target[c], decode(blob, n, 2))
        apply_s.append(time.perf_counter() - t1)
        encode_s.append(t1 - t0)
        assert np.array_equal(target, current)
    delta_bytes = sum(len(b) for b in blobs)
    return {"density": density, "pages": pages, "page_bytes": PAGE_BYTES * pages, "delta_bytes": delta_bytes,
            "delta_encode_gbytes_per_s": round(PAGE_BYTES * pages / min(encode_s) / 1e9, 4),
            "delta_apply_gbytes_per_s": round(delta_bytes / min(apply_s) / 1e9, 4),
            "load": round(os.getloadavg()[0], 1), "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.0115, help="changed fraction of units (default: bench-delta's fp8 lr 1e-6)")
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--write", type=Path, metavar="CLUSTER", help="set the two rates in this cluster file")
    args = parser.parse_args()
    if not 0 < args.density <= 1 or args.pages < 1:
        parser.error("--density must be in (0, 1] and --pages positive")
    out = measure(args.density, args.pages)
    print(json.dumps(out))
    if args.write:
        data = json.loads(args.write.read_text())
        how = (f"benchmarks/measure_delta_codec.py --density {args.density} at {out['measured_at']} (load {out['load']}): "
               "numpy, one core, bf16 pages of 64 KiB; ")
        data["delta_encode_gbytes_per_s"] = out["delta_encode_gbytes_per_s"]
        data["delta_apply_gbytes_per_s"] = out["delta_apply_gbytes_per_s"]
        data.setdefault("sources", {})["delta_encode_gbytes_per_s"] = how + "page bytes diffed, encoded and kept per second"
        data["sources"]["delta_apply_gbytes_per_s"] = how + "delta bytes decoded and written into pages per second"
        args.write.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
