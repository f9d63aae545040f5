"""lower_runs: turn each strided copy into element runs that are contiguous on both sides."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Geometry, Program, Runs


def lower_runs(program: Program) -> Program:
    """Lower every Copy to runs (global src offset, dst offset, length), in elements."""
    src_index, dst_index = program.source_index(), program.dest_index()
    chains: dict[tuple[str, ...], int] = {c: i for i, c in enumerate(program.cast_chains)}
    counts, src_ids, dst_ids, wires, src_offs, dst_offs, lengths = [], [], [], [], [], [], []
    for copy in program.copies:
        src_off, dst_off, length = strided_runs(copy.src_geom, copy.dst_geom)
        counts.append(len(length))
        src_ids.append(src_index[copy.src])
        dst_ids.append(dst_index[copy.dest])
        wires.append(chains.setdefault(copy.casts, len(chains)))
        src_offs.append(src_off)
        dst_offs.append(dst_off)
        lengths.append(length)
    counts = np.array(counts, dtype=np.int64)

    def per_run(values: list[int]) -> np.ndarray:
        return np.repeat(np.array(values, dtype=np.int64), counts)

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    arrays = {
        "src": per_run(src_ids), "src_off": joined(src_offs), "dest": per_run(dst_ids),
        "dst_off": joined(dst_offs), "length": joined(lengths), "wire": per_run(wires),
    }
    runs = Runs(**arrays, src_rank=np.zeros(len(arrays["length"]), dtype=np.int64))
    return dataclasses.replace(program, runs=runs, cast_chains=tuple(chains))


def strided_runs(src: Geometry, dst: Geometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    assert src.shape == dst.shape, (src, dst)
    if src.numel == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    if src.strides == dst.strides == Geometry.contiguous(dst.shape).strides:
        # Fast path: both sides contiguous, one run (the common case by far).
        return np.array([src.offset]), np.array([dst.offset]), np.array([src.numel])
    # Size-1 dims carry no stride information; visit the rest in destination memory order.
    dims = [d for d, n in enumerate(dst.shape) if n != 1]
    dims.sort(key=lambda d: -dst.strides[d])
    shape = [dst.shape[d] for d in dims]
    s_str = [src.strides[d] for d in dims]
    d_str = [dst.strides[d] for d in dims]
    # Merge neighbouring dims that are one contiguous stretch on both sides.
    i = len(shape) - 2
    while i >= 0:
        if s_str[i] == s_str[i + 1] * shape[i + 1] and d_str[i] == d_str[i + 1] * shape[i + 1]:
            shape[i] *= shape[i + 1]
            s_str[i], d_str[i] = s_str[i + 1], d_str[i + 1]
            del shape[i + 1], s_str[i + 1], d_str[i + 1]
        i -= 1
    if shape and s_str[-1] == 1 and d_str[-1] == 1:
        length = shape.pop()
        s_str.pop()
        d_str.pop()
    else:
        length = 1
    src_off = np.array([src.offset], dtype=np.int64)
    dst_off = np.array([dst.offset], dtype=np.int64)
    for n, ss, ds in zip(shape, s_str, d_str):
        step = np.arange(n, dtype=np.int64)
        src_off = (src_off[:, None] + step[None, :] * ss).reshape(-1)
        dst_off = (dst_off[:, None] + step[None, :] * ds).reshape(-1)
    return src_off, dst_off, np.full(len(src_off), length, dtype=np.int64)
