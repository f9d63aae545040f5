"""Benchmark: BlockQuantizer's numba kernel against its torch path on one thread, same data, one run.

Usage: python benchmarks/bench_quantizer.py [--repeats N] [--device cpu|cuda]
Cases: a 4096 x 7168 bf16 matrix, and a stack of 16 experts (512 x 7168 each) quantized expert by expert
through 2-D views of half their columns (row pitch 7168, so rows are strided). Per case it prints the
median over N interleaved repeats of G elements/s for each path and their ratio, after checking that both
paths wrote the same bytes. The kernel's first call (numba compile or cache load, plus the first pass) is
timed apart and not among the repeats. The last line is JSON.

--device cuda: the Triton kernel against the torch path on the GPU instead (benchmarks/triton_quantizer.py: bytes
under both roundings, GB/s of bf16 input); without a CUDA device it prints one JSON line saying skipped, exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from weightplan.runtime.fp8.numerics import BlockQuantizer


def _cases() -> dict[str, list[torch.Tensor]]:
    """Name -> 2-D bf16 views quantized one after another."""
    g = torch.Generator().manual_seed(0)
    matrix = (torch.randn(4096, 7168, generator=g) * 0.02).to(torch.bfloat16)
    stack = (torch.randn(16, 512, 7168, generator=g) * 0.02).to(torch.bfloat16)
    return {"4096x7168": [matrix], "experts 16x512x7168[:, :, 1024:4608]": [e[:, 1024:4608] for e in stack]}


def _outputs(views: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.empty(v.shape, dtype=torch.float8_e4m3fn), torch.empty(-(-v.shape[0] // 128), -(-v.shape[1] // 128)))
            for v in views]


def _run(quantize: BlockQuantizer, views: list[torch.Tensor], outs) -> float:
    start = time.perf_counter()
    for v, (values, scales) in zip(views, outs):
        quantize(v, values, scales)
    return time.perf_counter() - start


def _measure(name: str, views: list[torch.Tensor], paths: dict[str, BlockQuantizer], repeats: int) -> dict:
    """One case: the kernel's first call, a byte comparison of the two paths, then interleaved repeats."""
    elements = sum(v.numel() for v in views)
    outs = {p: _outputs(views) for p in paths}
    first = _run(paths["numba"], views, outs["numba"])
    _run(paths["torch"], views, outs["torch"])
    same = all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
               for a, b in zip(outs["numba"], outs["torch"]))
    times = {p: [] for p in paths}
    for _ in range(repeats):
        for p, q in paths.items():
            times[p].append(_run(q, views, outs[p]))
    rate = {p: round(elements / statistics.median(t) / 1e9, 3) for p, t in times.items()}
    return {"case": name, "elements": elements, "torch_gelem_s": rate["torch"], "numba_gelem_s": rate["numba"],
            "numba_over_torch": round(rate["numba"] / rate["torch"], 2), "numba_first_call_s": round(first, 3),
            "identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda":
        from triton_quantizer import measure_triton_quantizer

        print(json.dumps(measure_triton_quantizer("cuda", repeats=max(args.repeats, 5))))
        return
    torch.set_num_threads(1)
    paths = {"torch": BlockQuantizer("cuda", use_kernel=False), "numba": BlockQuantizer("cuda", use_kernel=True)}
    print(f"load average at start {os.getloadavg()}")
    results = [_measure(name, views, paths, args.repeats) for name, views in _cases().items()]
    for r in results:
        print("{case}: {elements} elements, median of {n} interleaved repeats, G elements/s: torch {torch_gelem_s}, "
              "numba {numba_gelem_s}, numba / torch {numba_over_torch}; numba first call {numba_first_call_s} s "
              "(compile or cache load + one pass, not among the repeats); same bytes: {identical}".format(n=args.repeats, **r))
    print(f"load average at end {os.getloadavg()}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
