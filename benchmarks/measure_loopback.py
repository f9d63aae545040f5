"""Measure this machine's loopback "NIC": process_vm_readv GB/s per reading process, per-iovec cost, fp8 quantizer GB/s.

Usage: python benchmarks/measure_loopback.py [--readers 2] [--sources 2] [--mib 256] [--write FILE]

Layout as in `make bench-runtime`: `--sources` processes each hold a buffer of `--mib` MiB;
`--readers` processes read every source's buffer at once (8 MiB iovecs, the cma path UCX takes for
NIXL READs between processes). The per-process rate is the bytes each reader moved over the
slowest reader's time (median of 3 rounds). The per-descriptor cost is the runtime's sender-side
packing of 100k runs of 128 B (runs under 64 KiB travel packed, so this is what many small
descriptors cost it); the kernel's per-iovec cost (100k iovecs of 128 B, minus their bytes at the
single reader's rate) is printed beside it. The quantizer rate is
weightplan.runtime.fp8.numerics.BlockQuantizer (the runtime's numba kernel) on one core. With --write, the figures go into a cluster
file (compiler/simulate/clusters/loopback.json schema) with one "node" per process. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path

import numpy as np

_LIBC = ctypes.CDLL(None, use_errno=True)
IOV_MAX = 1024
CHUNK = 8 << 20


def _source(nbytes: int, conn, stop) -> None:
    buf = np.ones(nbytes, dtype=np.uint8)
    conn.send((os.getpid(), buf.ctypes.data))
    stop.wait()


def _readv(pid: int, local: np.ndarray, remote: np.ndarray) -> int:
    total = 0
    for lo in range(0, len(local), IOV_MAX):
        n = min(IOV_MAX, len(local) - lo)
        got = _LIBC.process_vm_readv(pid, ctypes.c_void_p(local[lo:].ctypes.data), n, ctypes.c_void_p(remote[lo:].ctypes.data), n, 0)
        if got < 0:
            raise OSError(ctypes.get_errno(), "process_vm_readv failed (ptrace scope? run as the same user)")
        total += got
    return total


def _iovecs(base: int, nbytes: int, size: int) -> np.ndarray:
    starts = np.arange(0, nbytes, size, dtype=np.uint64)
    return np.stack([base + starts, np.minimum(size, nbytes - starts).astype(np.uint64)], axis=1).copy()


def _reader(sources: list[tuple[int, int]], nbytes: int, start, out) -> None:
    dst = np.empty(nbytes * len(sources), dtype=np.uint8)
    dst.fill(0)
    plans = [(pid, _iovecs(dst.ctypes.data + k * nbytes, nbytes, CHUNK), _iovecs(addr, nbytes, CHUNK))
             for k, (pid, addr) in enumerate(sources)]
    start.wait()
    began = time.perf_counter()
    moved = sum(_readv(pid, local, remote) for pid, local, remote in plans)
    out.put((moved, time.perf_counter() - began))


def concurrent_rate(readers: int, sources: list[tuple[int, int]], nbytes: int) -> float:
    """Bytes per second each reader achieves while all read all sources at once."""
    start, out = mp.Event(), mp.Queue()
    procs = [mp.Process(target=_reader, args=(sources, nbytes, start, out)) for _ in range(readers)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # let the readers fault in their destinations
    start.set()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return min(moved for moved, _ in results) / max(seconds for _, seconds in results)


def per_iovec_seconds(source: tuple[int, int], rate: float, n: int = 100_000, size: int = 128) -> float:
    pid, addr = source
    dst = np.zeros(n * size, dtype=np.uint8)
    local, remote = _iovecs(dst.ctypes.data, n * size, size), _iovecs(addr, n * size, size)
    times = []
    for _ in range(3):
        began = time.perf_counter()
        _readv(pid, local, remote)
        times.append(time.perf_counter() - began)
    return max(statistics.median(times) - n * size / rate, 0.0) / n


def pack_seconds(n: int = 100_000, size: int = 128) -> float:
    """Per small run: the sender packing n runs of `size` bytes, read in reverse order, with the runtime's
    Gather (runs under 64 KiB travel packed; the receiver then reads them as a few large descriptors)."""
    import torch

    from weightplan.runtime.sender.gather import Gather

    torch.set_num_threads(1)
    src, out = torch.ones(n * size, dtype=torch.uint8), torch.empty(n * size, dtype=torch.uint8)
    offsets = np.arange(n, dtype=np.int64)[::-1].copy() * size
    gather = Gather([src], out, np.zeros(n, dtype=np.int64), offsets, np.full(n, size, dtype=np.int64),
                    np.arange(n, dtype=np.int64) * size, 8)
    gather()
    times = []
    for _ in range(3):
        began = time.perf_counter()
        gather()
        times.append(time.perf_counter() - began)
    return statistics.median(times) / n


def quantizer_rate() -> float:
    import torch

    from weightplan.runtime.fp8.numerics import BlockQuantizer

    torch.set_num_threads(1)
    x = torch.randn(4096, 4096, dtype=torch.bfloat16)
    values, scales = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(32, 32, dtype=torch.float32)
    quantize = BlockQuantizer("cuda")
    quantize.warm_up()
    quantize(x, values, scales)
    times = []
    for _ in range(3):
        began = time.perf_counter()
        quantize(x, values, scales)
        times.append(time.perf_counter() - began)
    return x.numel() * 2 / statistics.median(times)


# The processes a simulated plan may start, trainers and inference together, each its own "node" (not how many this
# script measured): a 4-rank pipelined plan and its 4 trainers need 8.
PROCESS_SLOTS = 64


def cluster_file(rate: float, descriptor_s: float, quant: float, when: str) -> dict:
    return {
        "name": "loopback",
        "description": "This machine: every process is its own 'node' with one 'NIC', the kernel's process_vm_readv "
                       "(UCX's cma path for NIXL READs between processes), at the rate each reader got while "
                       f"all readers read at once ({when}).",
        "nodes": {"process": {"count": PROCESS_SLOTS, "gpus_per_node": 1}},
        "trainer": "process",
        "inference": "process",
        "nics_per_gpu": 1,
        "nic_gbytes_per_s": round(rate / 1e9, 3),
        "intra_node_gbytes_per_s": round(rate / 1e9, 3),
        "descriptor_us": round(descriptor_s * 1e6, 4),
        "sender_quant_gbytes_per_s": round(quant / 1e9, 3),
        "receiver_quant_gbytes_per_s": round(quant / 1e9, 3),
        "sources": {
            "nodes": "one per process a simulated plan starts, trainers and inference together (not the processes measured)",
            "nic_gbytes_per_s": "benchmarks/measure_loopback.py: process_vm_readv per reading process, all readers at once",
            "intra_node_gbytes_per_s": "unused (one process per node); set to the NIC rate",
            "descriptor_us": "benchmarks/measure_loopback.py: the runtime's sender-side packing (runtime/sender/gather.py) of 100k runs of 128 B, per run",
            "sender_quant_gbytes_per_s": "benchmarks/measure_loopback.py: weightplan.runtime.fp8.numerics.BlockQuantizer, one core, bf16 in",
            "receiver_quant_gbytes_per_s": "same as sender_quant_gbytes_per_s",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--sources", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256, help="MiB each source holds (each reader reads all of it)")
    parser.add_argument("--write", type=Path, help="write a cluster file with the measured figures")
    args = parser.parse_args()
    nbytes = args.mib << 20
    stop = mp.Event()
    conns, procs = [], []
    for _ in range(args.sources):
        parent, child = mp.Pipe()
        procs.append(mp.Process(target=_source, args=(nbytes, child, stop)))
        procs[-1].start()
        conns.append(parent)
    sources = [c.recv() for c in conns]
    try:
        rate = statistics.median(concurrent_rate(args.readers, sources, nbytes) for _ in range(3))
        single = statistics.median(concurrent_rate(1, sources[:1], nbytes) for _ in range(3))
        iovec = per_iovec_seconds(sources[0], single)
    finally:
        stop.set()
        for p in procs:
            p.join()
    quant = quantizer_rate()
    pack = pack_seconds()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    figures = {"readers": args.readers, "sources": args.sources, "per_reader_gbps": round(rate / 1e9, 3),
               "single_reader_gbps": round(single / 1e9, 3), "iovec_us": round(iovec * 1e6, 4), "pack_us": round(pack * 1e6, 4),
               "quantizer_gbps": round(quant / 1e9, 3), "measured": when, "load_average": os.getloadavg()[0]}
    print(f"process_vm_readv: {rate / 1e9:.3f} GB/s per reader with {args.readers} readers x {args.sources} sources at once, "
          f"{single / 1e9:.3f} GB/s alone; {iovec * 1e6:.4f} us per 128 B iovec, {pack * 1e6:.4f} us per 128 B run packed; fp8 quantizer {quant / 1e9:.3f} GB/s bf16 in "
          f"(one core); load average {figures['load_average']:.1f}")
    if args.write:
        args.write.write_text(json.dumps(cluster_file(rate, pack, quant, when), indent=2) + "\n")
        print(f"wrote {args.write}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
