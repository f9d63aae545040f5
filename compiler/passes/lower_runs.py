"""lower_runs: turn each strided copy into runs of rows that are contiguous on both sides."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..ir import Geometry, Program, Runs


def lower_runs(program: Program) -> Program:
    """Lower every Copy to runs (global src offset, dst offset, length; count and strides for its rows), in elements."""
    src_index, dst_index = program.source_index(), program.dest_index()
    chains: dict[tuple[str, ...], int] = {c: i for i, c in enumerate(program.cast_chains)}
    n_runs, ids, columns = [], [], []
    for copy in program.copies:
        lowered = strided_runs(copy.src_geom, copy.dst_geom)
        n_runs.append(len(lowered[0]))
        ids.append((src_index[copy.src], dst_index[copy.dest], chains.setdefault(copy.casts, len(chains))))
        columns.append(lowered)
    n_runs = np.array(n_runs, dtype=np.int64)

    def per_run(k: int) -> np.ndarray:
        return np.repeat(np.array([i[k] for i in ids], dtype=np.int64), n_runs)

    def joined(k: int) -> np.ndarray:
        return np.concatenate([c[k] for c in columns]).astype(np.int64) if columns else np.zeros(0, dtype=np.int64)

    src_off, dst_off, length, count, src_stride, dst_stride = (joined(k) for k in range(6))
    runs = Runs(per_run(0), src_off, per_run(1), dst_off, length, per_run(2), np.zeros(len(length), dtype=np.int64),
                count, src_stride, dst_stride)
    return dataclasses.replace(program, runs=runs, cast_chains=tuple(chains))


def strided_runs(src: Geometry, dst: Geometry) -> tuple[np.ndarray, ...]:
    """(src_off, dst_off, length, count, src_stride, dst_stride) of the runs copying src to dst.

    The innermost dim contiguous on both sides (after merging dims that continue each other)
    is the row length; the next dim out becomes the run's count and strides; any dims further
    out are enumerated, one run each, in destination memory order.
    """
    assert src.shape == dst.shape, (src, dst)
    empty = np.zeros(0, dtype=np.int64)
    if src.numel == 0:
        return (empty,) * 6
    one, zero = np.ones(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    if src.strides == dst.strides == Geometry.contiguous(dst.shape).strides:
        # Fast path: both sides contiguous, one run (the common case by far).
        return np.array([src.offset]), np.array([dst.offset]), np.array([src.numel]), one, zero, zero
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
    if shape:
        count, src_stride, dst_stride = shape.pop(), s_str.pop(), d_str.pop()
    else:
        count, src_stride, dst_stride = 1, 0, 0
    src_off = np.array([src.offset], dtype=np.int64)
    dst_off = np.array([dst.offset], dtype=np.int64)
    for n, ss, ds in zip(shape, s_str, d_str):
        step = np.arange(n, dtype=np.int64)
        src_off = (src_off[:, None] + step[None, :] * ss).reshape(-1)
        dst_off = (dst_off[:, None] + step[None, :] * ds).reshape(-1)
    n = len(src_off)
    return (src_off, dst_off, np.full(n, length, dtype=np.int64), np.full(n, count, dtype=np.int64),
            np.full(n, src_stride, dtype=np.int64), np.full(n, dst_stride, dtype=np.int64))
