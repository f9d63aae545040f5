"""Measure this host's delta encode and apply rates (the batched numba codec of runtime/delta) for simulate-plan's cluster files.

Usage: python benchmarks/measure_delta_codec.py [--density D] [--pages N] [--write CLUSTER.json]

Encode: what `Sender.publish` does for one page space (runtime/sender/delta.py: runtime/delta/kernels.py
encode_pages over `--pages` 64 KiB bf16 pages): diff against the previous version, encode the changed units, copy
the pages into the previous version; page bytes per second. Apply: what a receiver does with those blobs
(runtime/receiver/delta.py through runtime/delta/apply.py): decode them all, map the changes through its READ
targets (here one per page, into one destination entry) and scatter them into the destination; delta bytes per
second (and `apply_page_gbytes_per_s`: the same time per page byte). Each checks the result against the per-page
reference (runtime/delta/encode.py) or the new bytes. Best of 5, one process, the kernels compiled (or loaded from
numba's cache) before timing. The rates are per second of the thread's CPU time (`time.thread_time`: one core's
rate, which a shared machine's scheduling does not dilute); the `_wall` rates are per wall-clock second. Host-specific
and worth their order of magnitude only. --write sets `delta_encode_gbytes_per_s` and
`delta_apply_gbytes_per_s` (and their sources) in a cluster file, leaving the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from weightplan.runtime.delta import kernels
from weightplan.runtime.delta.apply import apply_writes, decode_all, destination_list, keyed_targets, page_keys, writes_of
from weightplan.runtime.delta.encode import Encoding, changed, encode
from weightplan.runtime.delta.pages import PAGE_BYTES, Pages, Targets

REPEATS = 5


def measure(density: float, pages: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = PAGE_BYTES // 2
    previous = rng.integers(0, 1 << 16, n * pages, dtype=np.uint16)
    current = previous.copy()
    hit = rng.random(n * pages) < density
    current[hit] ^= rng.integers(1, 1 << 16, int(hit.sum())).astype(np.uint16)
    rows = np.arange(pages, dtype=np.int64)
    starts = rows * PAGE_BYTES
    page_table = Pages(np.zeros(pages, np.int64), np.zeros(pages, np.int64), starts, np.full(pages, PAGE_BYTES), np.full(pages, 2))
    found = Targets(np.zeros(pages, np.int64), np.zeros(pages, np.int64), starts, np.full(pages, PAGE_BYTES),
                    np.zeros(pages, np.int64), starts)
    keys, keyed = page_keys(page_table), keyed_targets(page_table, found)
    region = np.zeros(2 * PAGE_BYTES * pages, dtype=np.uint8)
    scratch, ends = np.empty(n, dtype=np.int64), np.zeros(pages, dtype=np.int64)
    encode_s, apply_s, encode_cpu, apply_cpu, used = [], [], [], [], 0
    for _ in range(REPEATS + 1):  # the first round compiles or loads the kernels
        old = previous.copy()
        c0, t0 = time.thread_time(), time.perf_counter()
        used, fits, _ = kernels.encode_pages(current, current.view(np.uint8), 2, old, rows * n, np.full(pages, n), region,
                                             0, len(region), True, ends, rows, scratch, np.zeros(max(Encoding) + 1, np.int64))
        e_cpu, e_wall = time.thread_time() - c0, time.perf_counter() - t0
        assert fits and np.array_equal(old, current)
        target = previous.copy()
        destination = destination_list({0: target.view(np.uint8)}, 1)  # built once per receiver, at its start
        c1, t1 = time.thread_time(), time.perf_counter()
        changes = decode_all(region, np.concatenate([[0], ends[:-1]]), np.diff(ends, prepend=0), rows, page_table, keys)
        apply_writes(writes_of(changes, keyed, np.array([2 * n * pages])), destination)
        c2, t2 = time.thread_time(), time.perf_counter()
        assert np.array_equal(target, current)
        encode_s.append(e_wall)
        apply_s.append(t2 - t1)
        encode_cpu.append(e_cpu)
        apply_cpu.append(c2 - c1)
    reference = np.concatenate([encode(current[c], changed(previous[c], current[c]))
                                for c in (slice(p * n, (p + 1) * n) for p in range(pages))])
    assert np.array_equal(region[:used], reference), "the batched encoder's blobs differ from encode.encode's"
    return {"density": density, "pages": pages, "page_bytes": PAGE_BYTES * pages, "delta_bytes": used,
            "delta_encode_gbytes_per_s": round(PAGE_BYTES * pages / min(encode_cpu[1:]) / 1e9, 4),
            "delta_apply_gbytes_per_s": round(used / min(apply_cpu[1:]) / 1e9, 4),
            "delta_encode_wall_gbytes_per_s": round(PAGE_BYTES * pages / min(encode_s[1:]) / 1e9, 4),
            "delta_apply_wall_gbytes_per_s": round(used / min(apply_s[1:]) / 1e9, 4),
            "apply_page_gbytes_per_s": round(PAGE_BYTES * pages / min(apply_cpu[1:]) / 1e9, 4),
            "load": round(os.getloadavg()[0], 1), "measured_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.0115, help="changed fraction of units (default: bench-delta's fp8 lr 1e-6)")
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--write", type=Path, metavar="CLUSTER", help="set the two rates in this cluster file")
    parser.add_argument("--smoke", action="store_true", help="4 pages: runs, prints its JSON line (make test)")
    args = parser.parse_args()
    if args.smoke:
        args.pages = 4
    if not 0 < args.density <= 1 or args.pages < 1:
        parser.error("--density must be in (0, 1] and --pages positive")
    out = measure(args.density, args.pages)
    print(json.dumps(out))
    if args.write:
        data = json.loads(args.write.read_text())
        how = (f"benchmarks/measure_delta_codec.py --density {args.density} at {out['measured_at']} (load {out['load']}): "
               "the batched numba codec (runtime/delta/kernels.py), one core's CPU time, bf16 pages of 64 KiB; ")
        data["delta_encode_gbytes_per_s"] = out["delta_encode_gbytes_per_s"]
        data["delta_apply_gbytes_per_s"] = out["delta_apply_gbytes_per_s"]
        data.setdefault("sources", {})["delta_encode_gbytes_per_s"] = how + "page bytes diffed, encoded and kept per second"
        data["sources"]["delta_apply_gbytes_per_s"] = how + ("delta bytes decoded, mapped through READ targets and "
                                                             "written into a destination per second")
        args.write.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
