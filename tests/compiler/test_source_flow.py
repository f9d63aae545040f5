"""Replicated trainer bytes split among their holders by max-flow: optimal, never worse than greedy, plans stay exact."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import Program, Runs, TensorEntry
from weightplan.compiler.passes.coalesce import coalesce
from weightplan.compiler.passes.source_flow import fill_quotas, min_max_quotas
from weightplan.compiler.passes.split_shards import split_shards
from weightplan.compiler.passes.verify import verify
from weightplan.runtime.layout.shards import TrainerLayout, shard_box


@st.composite
def holder_cases(draw):
    ranks = draw(st.integers(2, 4))
    fixed = np.array(draw(st.lists(st.integers(0, 6), min_size=ranks, max_size=ranks)), dtype=np.int64)
    n_groups = draw(st.integers(1, 3))
    groups = [np.array(sorted(draw(st.sets(st.integers(0, ranks - 1), min_size=2, max_size=ranks))), dtype=np.int64)
              for _ in range(n_groups)]
    totals = np.array(draw(st.lists(st.integers(0, 5), min_size=n_groups, max_size=n_groups)), dtype=np.int64)
    return fixed, groups, totals


def _brute_force(fixed, groups, totals) -> int:
    """The least maximum load over every way of dealing each group's whole bytes to its members."""
    options = []
    for members, total in zip(groups, totals):
        splits = [c for c in itertools.product(range(int(total) + 1), repeat=len(members)) if sum(c) == total]
        options.append([(members, c) for c in splits])
    best = None
    for choice in itertools.product(*options):
        load = fixed.copy()
        for members, c in choice:
            load[members] += c
        best = load.max() if best is None else min(best, load.max())
    return int(best)


@settings(max_examples=150, deadline=None)
@given(holder_cases())
def test_quotas_are_optimal_by_brute_force(case):
    fixed, groups, totals = case
    bound, quota = min_max_quotas(fixed, groups, totals)
    assert bound == _brute_force(fixed, groups, totals)
    assert (quota.sum(1) == totals).all()
    assert (fixed + quota.sum(0) <= bound).all()
    for g, members in enumerate(groups):
        outside = np.setdiff1d(np.arange(len(fixed)), members)
        assert not quota[g, outside].any()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 3)), min_size=1, max_size=6), st.data())
def test_fill_cuts_pieces_at_unit_boundaries_into_quotas(pieces, data):
    units = np.array([u for _, u in pieces], dtype=np.int64)
    weight = np.array([n for n, _ in pieces], dtype=np.int64) * units
    total = int(weight.sum())
    cuts = sorted(data.draw(st.lists(st.integers(0, total), max_size=3)))
    quota = np.diff(np.array([0, *cuts, total], dtype=np.int64))
    piece, first, stop, share = fill_quotas(weight, units, quota)
    assert (stop > first).all() and (share >= 0).all() and (share < len(quota)).all()
    for p in range(len(pieces)):  # every unit of every piece in exactly one part, in order
        mine = piece == p
        assert first[mine][0] == 0 and stop[mine][-1] == pieces[p][0]
        assert (first[mine][1:] == stop[mine][:-1]).all()
    served = np.bincount(share, weights=(stop - first) * units[piece], minlength=len(quota))
    assert served.sum() == total
    assert (np.abs(np.cumsum(served) - np.cumsum(quota)) < units.max()).all()  # each cut within a unit


@st.composite
def replicated_programs(draw):
    fsdp = draw(st.integers(1, 3))
    replicas = draw(st.integers(2, 3))
    layout = TrainerLayout(fsdp, 1, replicas)
    sources, runs = [], []
    for s in range(draw(st.integers(1, 3))):
        shape = (draw(st.integers(1, 7)), draw(st.integers(1, 5)))
        sources.append(TensorEntry(f"w{s}", shape, "float32"))
    dests = [TensorEntry(f"d{s}", spec.shape, "float32", ranks=tuple(sorted(draw(st.sets(st.integers(0, 3), min_size=1)))))
             for s, spec in enumerate(sources)]
    for s, spec in enumerate(sources):
        rows, cols = spec.shape
        if cols > 1 and rows > 1 and draw(st.booleans()):  # column slices as strided runs, the rest plain
            c = draw(st.integers(1, cols - 1))
            runs.append((s, 0, s, 0, c, rows, cols, cols))
            runs += [(s, r * cols + c, s, r * cols + c, cols - c, 1, 0, 0) for r in range(rows)]
            continue
        numel = rows * cols
        bounds = [0, *sorted(set(draw(st.lists(st.integers(1, numel - 1), max_size=4)) if numel > 1 else [])), numel]
        runs += [(s, lo, s, lo, hi - lo, 1, 0, 0) for lo, hi in zip(bounds[:-1], bounds[1:])]
    c = np.array(runs, dtype=np.int64).T
    zeros = np.zeros(len(runs), dtype=np.int64)
    table = Runs(src=c[0], src_off=c[1], dest=c[2], dst_off=c[3], length=c[4], wire=zeros, src_rank=zeros,
                 count=c[5], src_stride=c[6], dst_stride=c[7])
    return Program(sources=tuple(sources), dests=tuple(dests), runs=table, cast_chains=(("float32",),), trainer_layout=layout)


@settings(max_examples=120, deadline=None)
@given(replicated_programs())
def test_split_among_replicas_is_exact_and_never_worse_than_greedy(program):
    split = split_shards(program)
    again = split_shards(program).runs
    assert all(np.array_equal(getattr(split.runs, f), getattr(again, f)) for f in Runs.column_names())  # deterministic
    choice = split.source_choice
    assert choice.chosen_max <= choice.greedy_max
    assert (choice.method == "flow") == (choice.chosen_max < choice.greedy_max)
    merged = coalesce(split)
    verify(merged)  # every destination byte exactly once, in bounds
    layout = program.trainer_layout
    for s, spec in enumerate(program.sources):  # executed from real shards, each destination equals its source
        full = torch.randn(spec.shape)
        shards = {}
        for rank in range(layout.ranks):
            (r0, r1), (c0, c1) = shard_box(layout, spec.shape, "dense", rank)
            shards[rank] = full[r0:r1, c0:c1].contiguous().view(-1)
        out = torch.full((full.numel(),), float("nan"))
        rows = merged.runs.take(np.flatnonzero(merged.runs.src == s)).expand()
        for rank, so, do, k in zip(rows.src_rank.tolist(), rows.src_off.tolist(), rows.dst_off.tolist(), rows.length.tolist()):
            out[do : do + k] = shards[rank][so : so + k]
        assert torch.equal(out, full.view(-1))


def test_replicas_share_one_tensor_evenly_where_greedy_cannot():
    """One 6-row tensor read whole by one inference rank, two replicas: greedy must give the single
    piece to one replica; the split serves half from each."""
    program = Program(sources=(TensorEntry("w", (6, 4), "float32"),), dests=(TensorEntry("d", (6, 4), "float32"),),
                      runs=Runs.plain([0], [0], [0], [0], [24], [0], [0]), cast_chains=(("float32",),),
                      trainer_layout=TrainerLayout(1, 1, 2))
    split = split_shards(program)
    assert split.source_choice.greedy_max == 96 and split.source_choice.chosen_max == 48
    assert split.source_choice.method == "flow"
    assert sorted(split.runs.src_rank.tolist()) == [0, 1]


def test_fp8_plan_split_among_replicas_matches_vllm(plan_cache):
    """Replicated bytes split between HSDP replicas feed sender-side and gathered fp8 blocks; the plan
    still equals vLLM's own quantized load on every inference rank."""
    from weightplan.compiler.verify_plan import verify_plan
    from weightplan.runtime import load_plan

    from ..conftest import config_dir

    path = plan_cache("fp8-glm", "stacked", "bf16", "fsdp=4,ep=2,replicas=2", "dp=2,ep", "fp8_per_block")
    plan = load_plan(path)
    result = verify_plan(path, model=str(config_dir("fp8-glm")), seed=2, ranks=[1])  # one rank: the other is alike
    assert result.mismatches == ()
    assert result.tensors == sum(1 in e.ranks for e in plan.dests)
    served = plan.table["src_rank"]
    assert set(served.tolist()) == set(range(8))  # both replicas of every shard serve
