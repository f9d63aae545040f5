"""Property tests: splitting runs by trainer shards, executed from real shards, equals eager torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import Program, Runs, TensorEntry
from weightplan.compiler.passes.coalesce import coalesce
from weightplan.compiler.passes.split_shards import split_shards
from weightplan.compiler.passes.descriptor_counts import descriptors_lower_bound
from weightplan.compiler.passes.verify import verify
from weightplan.runtime.layout.shards import TrainerLayout, shard_box


@st.composite
def cases(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    ep = draw(st.sampled_from([1, 2, 3]))
    fsdp = ep * draw(st.integers(1, 3))
    layout = TrainerLayout(fsdp, ep, draw(st.integers(1, 2)))
    sharding = draw(st.sampled_from(["dense", "expert"]))
    numel = int(np.prod(shape))
    # Random runs tiling the destination with random source stretches (a permutation of pieces).
    cuts = sorted(set(draw(st.lists(st.integers(1, numel - 1), max_size=4)) if numel > 1 else []))
    bounds = [0, *cuts, numel]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    order = draw(st.permutations(range(len(pieces))))
    return shape, layout, sharding, pieces, order


@settings(max_examples=300, deadline=None)
@given(cases())
def test_split_runs_executed_from_shards_equal_eager(case):
    shape, layout, sharding, pieces, order = case
    numel = int(np.prod(shape))
    # Destination stretch k receives source stretch order[k] of the same length where possible:
    # run sources are laid out consecutively in the permuted order.
    src_start, rows = 0, []
    for k in order:
        lo, hi = pieces[k]
        rows.append((0, src_start, 0, lo, hi - lo, 0))
        src_start += hi - lo
    cols = np.array(rows, dtype=np.int64).T
    runs = Runs.plain(*cols, np.zeros(len(rows), dtype=np.int64))
    program = Program(
        sources=(TensorEntry("w", shape, "float32", sharding),),
        dests=(TensorEntry("d", (numel,), "float32", ranks=(0, 1)),),
        runs=runs,
        cast_chains=(("float32",),),
        trainer_layout=layout,
    )
    split = split_shards(program)
    merged = coalesce(split)
    verify(merged)
    assert descriptors_lower_bound(split.runs) == len(merged.runs)

    full = torch.randn(shape)
    shards = {}
    for rank in range(layout.ranks):
        box = shard_box(layout, shape, sharding, rank)
        t = full
        for dim, (a, b) in enumerate(box):
            t = t.narrow(dim, a, b - a)
        shards[rank] = t.contiguous().view(-1)
    out = torch.zeros(numel)
    r = merged.runs
    for rank, so, do, n in zip(r.src_rank.tolist(), r.src_off.tolist(), r.dst_off.tolist(), r.length.tolist()):
        out[do : do + n] = shards[rank][so : so + n]
    expected = torch.empty(numel)
    flat = full.reshape(-1)
    for (_, s, _, lo, length, _) in rows:
        expected[lo : lo + length] = flat[s : s + length]
    assert torch.equal(out, expected)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=3), st.integers(1, 4), st.sampled_from([1, 2]))
def test_shards_tile_the_tensor_exactly_once_per_replica(shape, fsdp, ep):
    shape = tuple(shape)
    layout = TrainerLayout(fsdp * ep, ep, 2)
    for sharding in ("dense", "expert"):
        for replica in range(layout.replicas):
            seen = torch.zeros(shape, dtype=torch.int64)
            for j in range(layout.fsdp):
                box = shard_box(layout, shape, sharding, replica * layout.fsdp + j)
                view = seen
                for dim, (a, b) in enumerate(box):
                    view = view.narrow(dim, a, b - a)
                view += 1
            assert bool((seen == 1).all())


def _cut_by_successive_cuts(runs: Runs, seg_start, seg_len, seg_local, seg_rank) -> Runs:
    """The oracle: cut every run at its current segment's end, one round of cuts at a time."""
    out = []
    src_off, dst_off, remaining = runs.src_off.copy(), runs.dst_off.copy(), runs.length.copy()
    alive = np.arange(len(runs))
    while len(alive):
        seg = np.searchsorted(seg_start, src_off, side="right") - 1
        take = np.minimum(remaining, seg_start[seg] + seg_len[seg] - src_off)
        out.append(dataclasses.replace(runs.take(alive), src_off=seg_local[seg] + (src_off - seg_start[seg]),
                                       dst_off=dst_off.copy(), length=take, src_rank=seg_rank[seg]))
        src_off, dst_off, remaining = src_off + take, dst_off + take, remaining - take
        left = remaining > 0
        alive, src_off, dst_off, remaining = alive[left], src_off[left], dst_off[left], remaining[left]
    return Runs.concat(out)


@settings(max_examples=300, deadline=None)
@given(cases(), st.integers(0, 3))
def test_vectorised_cut_equals_successive_cuts(case, wire):
    from weightplan.compiler.passes.split_shards import _cut, _segments

    shape, layout, sharding, pieces, order = case
    src_start, rows = 0, []
    for i, k in enumerate(order):
        lo, hi = pieces[k]
        rows.append((0, src_start, i % 2, lo, hi - lo, wire))
        src_start += hi - lo
    runs = Runs.plain(*np.array(rows, dtype=np.int64).T, np.zeros(len(rows), dtype=np.int64))
    segments = _segments([shard_box(layout, shape, sharding, r) for r in range(layout.ranks)], shape, [])
    got, want = _cut(runs, *segments), _cut_by_successive_cuts(runs, *segments)
    for name in Runs.column_names():
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


def test_cut_refuses_bytes_no_rank_holds():
    import pytest

    from weightplan.compiler.passes.split_shards import _cut
    from weightplan.runtime.errors import LayoutError

    runs = Runs.plain(*(np.array([v], dtype=np.int64) for v in (0, 2, 0, 0, 6, 0, 0)))
    gap = (np.array([0, 5]), np.array([4, 4]), np.array([0, 0]), np.array([0, 1]))  # element 4 is held by nobody
    with pytest.raises(LayoutError, match="held by no trainer rank"):
        _cut(runs, *gap)


@st.composite
def strided_cases(draw):
    """A 2-D or 3-D source tiled by a grid of boxes (each held by one or two ranks), and a
    sub-block of its last two dims (optionally transposed) copied into a contiguous destination."""
    shape = tuple(draw(st.integers(1, 7)) for _ in range(draw(st.integers(2, 3))))
    grid = [sorted(set(draw(st.lists(st.integers(1, n - 1), max_size=2)))) if n > 1 else [] for n in shape]
    cells = [list(zip([0, *cuts], [*cuts, n])) for cuts, n in zip(grid, shape)]
    boxes = [()]
    for dim_cells in cells:
        boxes = [box + (cell,) for box in boxes for cell in dim_cells]
    boxes = boxes * draw(st.integers(1, 2))  # replicas hold the same boxes
    r0 = draw(st.integers(0, shape[-2] - 1))
    r1 = draw(st.integers(r0 + 1, shape[-2]))
    c0 = draw(st.integers(0, shape[-1] - 1))
    c1 = draw(st.integers(c0 + 1, shape[-1]))
    lead = draw(st.integers(0, shape[0] - 1)) if len(shape) == 3 else None
    return shape, boxes, (lead, r0, r1, c0, c1), draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(strided_cases())
def test_strided_runs_split_by_any_boxes_equal_eager(case):
    from weightplan.compiler.ir import Geometry
    from weightplan.compiler.passes.lower_runs import strided_runs
    from weightplan.compiler.passes.split_shards import _cut, _segments

    shape, boxes, (lead, r0, r1, c0, c1), transpose = case
    strides = Geometry.contiguous(shape).strides
    base = (lead or 0) * (strides[0] if len(shape) == 3 else 0) + r0 * strides[-2] + c0
    block = (r1 - r0, c1 - c0)
    src = Geometry(base, block, (strides[-2], 1))
    if transpose:
        src = Geometry(base, block[::-1], (1, strides[-2]))
    dst = Geometry.contiguous(src.shape)
    columns = strided_runs(src, dst)
    n = len(columns[0])
    runs = Runs(np.zeros(n, dtype=np.int64), columns[0], np.zeros(n, dtype=np.int64), columns[1], columns[2],
                np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64), *columns[3:])
    groups: list[np.ndarray] = []
    cut = _cut(runs, *_segments(boxes, shape, groups))
    cut = dataclasses.replace(cut, src_rank=np.array([g[0] for g in groups], dtype=np.int64)[cut.src_rank])
    program = Program(sources=(TensorEntry("w", shape, "float32"),), dests=(TensorEntry("d", dst.shape, "float32"),),
                      runs=cut, cast_chains=(("float32",),))
    merged = coalesce(program)
    verify(merged)
    assert merged.runs.rows == descriptors_lower_bound(cut) == descriptors_lower_bound(cut.expand())
    assert merged.runs.rows <= cut.rows

    full = torch.randn(shape)
    shards = {}
    for rank, box in enumerate(boxes):
        t = full
        for d, (a, b) in enumerate(box):
            t = t.narrow(d, a, b - a)
        shards[rank] = t.contiguous().view(-1)
    out = torch.full((dst.numel,), float("nan"))
    rows = merged.runs.expand()
    for rank, so, do, k in zip(rows.src_rank.tolist(), rows.src_off.tolist(), rows.dst_off.tolist(), rows.length.tolist()):
        out[do : do + k] = shards[rank][so : so + k]
    view = full[lead] if lead is not None else full
    want = view[r0:r1, c0:c1]
    assert torch.equal(out.view(dst.shape), want.t().contiguous() if transpose else want)


def test_column_slice_across_row_shards_keeps_one_strided_piece_per_shard():
    """A TP column slice of an [8, 6] matrix whose rows four FSDP ranks hold in pairs: four pieces of two rows."""
    from weightplan.compiler.passes.split_shards import _cut, _segments

    shape = (8, 6)
    boxes = [((2 * r, 2 * r + 2), (0, 6)) for r in range(4)]
    runs = Runs(*(np.array([v], dtype=np.int64) for v in (0, 3, 0, 0, 3, 0, 0, 8, 6, 3)))  # columns 3:6 of every row
    cut = _cut(runs, *_segments(boxes, shape, []))
    assert cut.count.tolist() == [2, 2, 2, 2]
    assert cut.src_off.tolist() == [3, 3, 3, 3] and cut.dst_off.tolist() == [0, 6, 12, 18]
    assert cut.src_rank.tolist() == [0, 1, 2, 3]
