"""Property tests: splitting runs by trainer shards, executed from real shards, equals eager torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import Program, Runs, TensorSpec
from weightplan.compiler.passes.coalesce import coalesce
from weightplan.compiler.passes.split_shards import split_shards
from weightplan.compiler.passes.verify import descriptors_lower_bound, verify
from weightplan.runtime.shards import TrainerLayout, shard_box


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
    runs = Runs(*cols, np.zeros(len(rows), dtype=np.int64))
    program = Program(
        sources=(TensorSpec("w", shape, "float32", sharding),),
        dests=(TensorSpec("d", (numel,), "float32", ranks=(0, 1)),),
        runs=runs,
        cast_chains=(("float32",),),
        meta={"trainer_layout": layout},
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
    runs = Runs(*np.array(rows, dtype=np.int64).T, np.zeros(len(rows), dtype=np.int64))
    segments = _segments([shard_box(layout, shape, sharding, r) for r in range(layout.ranks)], shape, [])
    got, want = _cut(runs, *segments), _cut_by_successive_cuts(runs, *segments)
    for name in Runs.FIELDS:
        assert getattr(got, name).tolist() == getattr(want, name).tolist(), name


def test_cut_refuses_bytes_no_rank_holds():
    import pytest

    from weightplan.compiler.passes.split_shards import _cut

    runs = Runs(*(np.array([v], dtype=np.int64) for v in (0, 2, 0, 0, 6, 0, 0)))
    gap = (np.array([0, 5]), np.array([4, 4]), np.array([0, 0]), np.array([0, 1]))  # element 4 is held by nobody
    with pytest.raises(AssertionError, match="held by no trainer rank"):
        _cut(runs, *gap)
