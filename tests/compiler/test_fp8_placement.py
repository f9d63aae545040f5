"""place_quant on random shapes and shardings: each block once, on one side; sender blocks read only their rank; gathered blocks by one writer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import Program, QuantTarget, Runs, TensorEntry
from weightplan.compiler.passes.place_quant import place_quant
from weightplan.compiler.passes.quant_blocks import BlockGrids, block_intervals
from weightplan.compiler.passes.verify import PlanInvariantError
from weightplan.compiler.passes.verify_quant import verify_quant
from weightplan.runtime.fp8.numerics import block_grid


def block_ranges(shape: tuple[int, ...], off: int, length: int) -> list[tuple[int, int]]:
    """Flat block-id ranges [lo, hi) touched by elements [off, off + length) of one 2-D/3-D tensor (may overlap)."""
    grids = BlockGrids.of([shape])
    zero = np.zeros(1, dtype=np.int64)
    _, lo, hi = block_intervals(grids, zero, np.array([off], dtype=np.int64), np.array([length], dtype=np.int64))
    return list(zip(lo.tolist(), hi.tolist()))


def block_owners(shape: tuple[int, ...], offs, lengths, ranks) -> np.ndarray:
    """Reference, element by element: per flat block, the one trainer rank whose runs write it, or -1 (several or none)."""
    matrices, nbr, nbc = block_grid(shape)
    owner = np.full(matrices * nbr * nbc, -1, dtype=np.int64)
    shared = np.zeros(len(owner), dtype=bool)
    for off, length, rank in zip(offs, lengths, ranks):
        for lo, hi in block_ranges(shape, off, length):
            seen = owner[lo:hi]
            shared[lo:hi] |= (seen >= 0) & (seen != rank)
            owner[lo:hi] = rank
    owner[shared] = -1
    return owner


def _program(shape, pieces, ranks_of_dest=(0,)):
    """One bf16 source == one quantized destination; `pieces` = [(off, length, trainer rank)] tiling it (maybe with gaps)."""
    n = len(pieces)
    runs = Runs.plain(
        src=np.zeros(n, dtype=np.int64),
        src_off=np.array([p[0] for p in pieces], dtype=np.int64),
        dest=np.ones(n, dtype=np.int64),
        dst_off=np.array([p[0] for p in pieces], dtype=np.int64),
        length=np.array([p[1] for p in pieces], dtype=np.int64),
        wire=np.zeros(n, dtype=np.int64),
        src_rank=np.array([p[2] for p in pieces], dtype=np.int64),
    )
    sources = (TensorEntry("w", shape, "bfloat16"),)
    dests = (TensorEntry("norm", (4,), "bfloat16", ranks=ranks_of_dest), TensorEntry("layer.weight", shape, "bfloat16", ranks=ranks_of_dest))
    return Program(sources, dests, runs=runs, cast_chains=(("bfloat16",),),
                   quant_targets=(QuantTarget("layer.weight", "layer.weight", "layer.weight_scale_inv"),))


@st.composite
def sharded(draw):
    experts = draw(st.sampled_from([(), (1,), (3,)]))
    rows, cols = draw(st.integers(1, 520)), draw(st.integers(1, 300))
    shape = (*experts, rows, cols)
    numel = int(np.prod(shape))
    cuts = sorted(set(draw(st.lists(st.integers(1, max(numel - 1, 1)), max_size=8))) - {numel})
    bounds = [0, *cuts, numel]
    ranks = draw(st.lists(st.integers(0, 3), min_size=len(bounds) - 1, max_size=len(bounds) - 1))
    pieces = [(a, b - a, r) for a, b, r in zip(bounds, bounds[1:], ranks) if b > a]
    gaps = draw(st.booleans())  # padding: elements nobody writes
    if gaps and len(pieces) > 1:
        pieces = pieces[::2]
    return shape, pieces


def _block_ids(shape) -> np.ndarray:
    """Flat block id of every element, straight from the geometry (matrix, block row, block col)."""
    *lead, rows, cols = shape
    _, nbr, nbc = block_grid(shape)
    matrix, row, col = np.meshgrid(np.arange(int(np.prod(lead, dtype=np.int64))), np.arange(rows), np.arange(cols), indexing="ij")
    return ((matrix * nbr + row // 128) * nbc + col // 128).reshape(-1)


@settings(max_examples=150, deadline=None)
@given(sharded(), st.sampled_from([(0,), (0, 1, 2)]))
def test_every_block_once_on_one_side_and_sender_blocks_are_rank_local(case, holders):
    shape, pieces = case
    placed = place_quant(_program(shape, pieces, ranks_of_dest=holders))
    q = placed.quant_placement
    coverage = verify_quant([shape], [len(holders)], q.stage, q.spans)  # raises on any violated invariant
    matrices, nbr, nbc = block_grid(shape)
    assert coverage.blocks == (matrices * nbr * nbc) * len(holders)
    blocks = matrices * nbr * nbc
    # Brute force: the set of ranks writing each block, element by element.
    ids = _block_ids(shape)
    writers = [set() for _ in range(blocks)]
    for off, length, rank in pieces:
        for b in np.unique(ids[off : off + length]).tolist():
            writers[b].add(rank)
    side = np.full(blocks, -1)
    rank_of = np.full(blocks, -1)
    for first, n, s, r in zip(q.spans["first_block"], q.spans["n_blocks"], q.spans["side"], q.spans["src_rank"]):
        assert (side[first : first + n] == -1).all()
        side[first : first + n], rank_of[first : first + n] = s, r
    for b, ranks in enumerate(writers):
        expected = 0 if len(ranks) == 1 else 2 if len(ranks) > 1 and len(holders) > 1 else 1
        assert side[b] == expected, (b, ranks, side[b])
        if side[b] == 0:
            assert ranks == {rank_of[b]}
    # One gathering rank per block row, which writes some gathered block of that row (its own part never
    # crosses the network; with FSDP row shards every block of a row has the same writers).
    for band in range(matrices * nbr):
        row = np.arange(band * nbc, (band + 1) * nbc)
        gathered = row[side[row] == 2]
        assert len(set(rank_of[gathered].tolist())) <= 1
        if len(gathered):
            assert rank_of[gathered[0]] in set().union(*(writers[b] for b in gathered.tolist()))
    assert coverage.sender_blocks == int((side == 0).sum()) * len(holders)
    assert coverage.gathered_blocks == int((side == 2).sum()) * len(holders)
    st_ = q.stage
    listed = set(zip(st_["side"].tolist(), st_["src_rank"].tolist(), st_["quant_rank"].tolist(), st_["stage_off"].tolist()))
    for off, length, rank in pieces:
        touched = np.unique(ids[off : off + length])
        # Every (side, quantizing rank) of the blocks a piece writes lists that piece, and nothing else does.
        needed = {(int(side[b]), rank, int(rank_of[b]) if side[b] != 1 else -1, off) for b in touched.tolist()}
        assert needed == {row for row in listed if row[1] == rank and row[3] == off}


def test_dests_become_fp8_weight_and_scale_and_other_runs_stay():
    shape = (300, 200)
    prog = _program(shape, [(0, 128 * 200, 0), (128 * 200, 172 * 200, 1)], ranks_of_dest=(0, 2))
    placed = place_quant(prog)
    assert [(d.name, d.shape, d.dtype, d.ranks) for d in placed.dests] == [
        ("norm", (4,), "bfloat16", (0, 2)),
        ("layer.weight", (300, 200), "float8_e4m3fn", (0, 2)),
        ("layer.weight_scale_inv", (3, 2), "float32", (0, 2)),
    ]
    q = placed.quant_placement
    assert q.staging == (("layer.weight", shape, (0, 2), 1, 2),)
    # rows 0-127 from rank 0, 128-299 from rank 1: every block band lies within one rank.
    assert q.spans["side"].tolist() == [0, 0] and q.spans["src_rank"].tolist() == [0, 1]
    assert q.spans["n_blocks"].tolist() == [2, 4]
    assert len(placed.runs) == 0  # both runs went into the staging tensor


def test_unaligned_shards_send_shared_blocks_to_the_receiver():
    shape = (256, 128)
    placed = place_quant(_program(shape, [(0, 100 * 128, 0), (100 * 128, 156 * 128, 1)]))
    q = placed.quant_placement
    assert list(zip(q.spans["side"].tolist(), q.spans["src_rank"].tolist(), q.spans["n_blocks"].tolist())) == [(1, -1, 1), (0, 1, 1)]
    # rank 1's run feeds the shared block 0 (receiver) and its own block 1 (sender): listed on both sides
    sides = sorted(zip(q.stage["side"].tolist(), q.stage["src_rank"].tolist()))
    assert sides == [(0, 1), (1, 0), (1, 1)]


def test_block_owners_marks_untouched_blocks_as_receiver():
    owner = block_owners((2, 130, 10), [0], [130 * 10], [3])
    assert owner.tolist() == [3, 3, -1, -1]


def test_verify_quant_rejects_a_block_quantized_twice():
    shape = (128, 128)
    placed = place_quant(_program(shape, [(0, 128 * 128, 0)]))
    q = placed.quant_placement
    spans = {k: np.concatenate([v, v]) for k, v in q.spans.columns().items()}
    with pytest.raises(PlanInvariantError, match="quantized 2 times"):
        verify_quant([shape], [1], q.stage, spans)


def test_verify_quant_rejects_a_sender_block_fed_by_another_rank():
    shape = (128, 128)
    placed = place_quant(_program(shape, [(0, 128 * 128, 0)]))
    q = placed.quant_placement
    stage = {k: np.concatenate([v, v]) for k, v in q.stage.columns().items()}
    stage["src_rank"][1] = 1
    with pytest.raises(PlanInvariantError, match="also written from trainer rank 1"):
        verify_quant([shape], [1], stage, q.spans)


def test_verify_quant_rejects_a_receiver_block_whose_stage_run_stays_on_the_trainer():
    shape = (128, 128)
    placed = place_quant(_program(shape, [(0, 128 * 64, 0), (128 * 64, 128 * 64, 1)]))  # two ranks: receiver side
    q = placed.quant_placement
    assert (q.spans["side"] == 1).all()
    stage = {k: v.copy() for k, v in q.stage.columns().items()}
    stage["side"][0] = 0  # listed as a trainer-local copy, so no receiver pulls it
    with pytest.raises(PlanInvariantError, match="quantized on the receiver side but its stage run"):
        verify_quant([shape], [1], stage, q.spans)


def _reference_tables(shapes, pieces_of):
    """The per-run loop place_quant replaced (one tensor at a time, block by block): its stage and span rows."""
    stage_rows, span_rows = [], []
    for stage, (shape, pieces) in enumerate(zip(shapes, pieces_of)):
        pieces = sorted(pieces)
        owner = block_owners(shape, [p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces])
        change = np.flatnonzero(np.diff(owner)) + 1
        for lo, hi in zip([0, *change.tolist()], [*change.tolist(), len(owner)]):
            span_rows.append((stage, lo, hi - lo, 0 if owner[lo] >= 0 else 1, int(owner[lo])))
        for off, length, rank in pieces:
            touched = np.concatenate([owner[lo:hi] for lo, hi in block_ranges(shape, off, length)])
            for side, needed in ((0, (touched >= 0).any()), (1, (touched < 0).any())):
                if needed:
                    stage_rows.append((side, rank, stage, off, stage, off, length, 0))
    return stage_rows, span_rows


@settings(max_examples=100, deadline=None)
@given(st.lists(sharded(), min_size=1, max_size=3))
def test_vectorised_placement_equals_the_per_block_loop(cases):
    """Several quantized tensors at once (one shared block id space) give the rows of the loop, in its order."""
    shapes = [shape for shape, _ in cases]
    n = sum(len(p) for _, p in cases)
    cols = {f: [] for f in Runs.column_names()[:7]}
    for stage, (shape, pieces) in enumerate(cases):
        for off, length, rank in reversed(pieces):  # place_quant must order runs itself
            for f, v in zip(Runs.column_names(), (stage, off, stage, off, length, 0, rank)):
                cols[f].append(v)
    runs = Runs.plain(**{f: np.array(v, dtype=np.int64).reshape(n) for f, v in cols.items()})
    sources = tuple(TensorEntry(f"w{i}", shape, "bfloat16") for i, shape in enumerate(shapes))
    dests = tuple(TensorEntry(f"l{i}.weight", shape, "bfloat16") for i, shape in enumerate(shapes))
    quant = tuple(QuantTarget(f"l{i}.weight", f"l{i}.weight", f"l{i}.weight_scale_inv") for i in range(len(shapes)))
    q = place_quant(Program(sources, dests, runs=runs, cast_chains=(("bfloat16",),), quant_targets=quant)).quant_placement
    stage_rows, span_rows = _reference_tables(shapes, [p for _, p in cases])
    assert list(zip(*(q.stage[c].tolist() for c in ("side", "src_rank", "src", "src_off", "stage", "stage_off", "length", "wire")))) == stage_rows
    assert list(zip(*(q.spans[c].tolist() for c in ("stage", "first_block", "n_blocks", "side", "src_rank")))) == span_rows
    verify_quant(shapes, [1] * len(shapes), q.stage, q.spans)


def test_unaligned_shards_of_a_replicated_tensor_are_gathered_by_one_writer():
    shape = (256, 128)
    placed = place_quant(_program(shape, [(0, 100 * 128, 0), (100 * 128, 156 * 128, 1)], ranks_of_dest=(0, 1)))
    q = placed.quant_placement
    spans = list(zip(q.spans["side"].tolist(), q.spans["src_rank"].tolist(), q.spans["n_blocks"].tolist()))
    assert spans[1] == (0, 1, 1) and spans[0][0] == 2 and spans[0][1] in (0, 1)
    gatherer = spans[0][1]
    rows = sorted(zip(q.stage["side"].tolist(), q.stage["src_rank"].tolist(), q.stage["quant_rank"].tolist()))
    assert rows == sorted([(2, 0, gatherer), (2, 1, gatherer), (0, 1, 1)])
    coverage = verify_quant([shape], [2], q.stage, q.spans)
    assert (coverage.sender_blocks, coverage.gathered_blocks, coverage.blocks) == (2, 2, 4)


def test_verify_quant_rejects_a_gathered_block_not_fed_to_its_gatherer():
    shape = (256, 128)
    placed = place_quant(_program(shape, [(0, 100 * 128, 0), (100 * 128, 156 * 128, 1)], ranks_of_dest=(0, 1)))
    q = placed.quant_placement
    stage = {k: v.copy() for k, v in q.stage.columns().items()}
    wrong = np.flatnonzero(stage["side"] == 2)[0]
    stage["quant_rank"][wrong] = 3 - int(q.spans["src_rank"][0])  # a rank that does not gather that block
    with pytest.raises(PlanInvariantError, match="quantized on the gather side by trainer rank"):
        verify_quant([shape], [2], stage, q.spans)
