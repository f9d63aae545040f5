"""Small deterministic unit tests for each compiler pass on its own: fold_views, lower_runs,
coalesce, verify (and the pipeline driver that chains them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from weightplan.compiler.ir import Copy, Geometry, Program, Runs, TensorEntry
from weightplan.compiler.passes.coalesce import coalesce
from weightplan.compiler.passes.fold_views import fold_views
from weightplan.compiler.passes.lower_runs import lower_runs, strided_runs
from weightplan.compiler.passes.pipeline import Stage, join_ranks, run_all, run_stage
from weightplan.compiler.passes.descriptor_counts import descriptors_lower_bound
from weightplan.compiler.passes.verify import PlanInvariantError, verify

from ..support.pipeline_runs import timer
from ..support.tracing import W46, runs_table, trace


def one_copy(program: Program) -> Copy:
    (copy,) = fold_views(program).copies
    return copy


def stored(program: Program) -> list[tuple[int, ...]]:
    """Runs as stored: (src_off, dst_off, length, count, src_stride, dst_stride)."""
    r = program.runs
    return list(zip(*(getattr(r, f).tolist() for f in ("src_off", "dst_off", "length", "count", "src_stride", "dst_stride"))))


def make_runs(rows, ranks=None) -> Runs:
    """Runs from (src, src_off, dest, dst_off, length, wire) rows, all rank 0 -> rank 0."""
    cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    zeros = np.zeros(cols.shape[1], dtype=np.int64)
    return Runs.plain(*cols, zeros)




# --- fold_views ----------------------------------------------------------------------------


def test_fold_slice_moves_offset_and_multiplies_stride():
    p = trace(W46, {"d": ((3, 3), "float32")}, lambda w, d: d["d"].copy_(w["w"][1:4, ::2]))
    c = one_copy(p)
    assert c.src == "w" and c.dest == "d"
    assert c.src_geom == Geometry(6, (3, 3), (6, 2))
    assert c.dst_geom == Geometry(0, (3, 3), (3, 1))
    assert c.casts == ("float32",)


def test_fold_narrow_split_and_chunk_are_slices():
    p = trace(W46, {"a": ((4, 2), "float32"), "b": ((4, 2), "float32"), "c": ((1, 6), "float32")}, lambda w, d: (
        d["a"].copy_(w["w"].narrow(1, 4, 2)),
        d["b"].copy_(w["w"].split([1, 2, 3], dim=1)[2][:, 1:]),
        d["c"].copy_(w["w"].chunk(3, 0)[1][1:]),
    ))
    geoms = [c.src_geom for c in fold_views(p).copies]
    assert geoms == [Geometry(4, (4, 2), (6, 1)), Geometry(4, (4, 2), (6, 1)), Geometry(18, (1, 6), (6, 1))]


def test_fold_select_drops_dim_and_moves_offset():
    p = trace(W46, {"d": ((4,), "float32")}, lambda w, d: d["d"].copy_(w["w"].select(1, -4)))
    assert one_copy(p).src_geom == Geometry(2, (4,), (6,))


def test_fold_unbind_is_select():
    p = trace(W46, {"d": ((6,), "float32")}, lambda w, d: d["d"].copy_(w["w"].unbind(0)[3]))
    assert one_copy(p).src_geom == Geometry(18, (6,), (1,))


def test_fold_permute_reorders_shape_and_strides():
    p = trace({"w": ((2, 3, 4), "float32")}, {"d": ((4, 2, 3), "float32")},
              lambda w, d: d["d"].copy_(w["w"].permute(2, 0, 1)))
    assert one_copy(p).src_geom == Geometry(0, (4, 2, 3), (1, 12, 4))


def test_fold_transpose_and_t_are_permutes():
    p = trace(W46, {"a": ((6, 4), "float32"), "b": ((6, 4), "float32")}, lambda w, d: (
        d["a"].copy_(w["w"].t()), d["b"].copy_(w["w"].transpose(-1, 0))))
    assert [c.src_geom for c in fold_views(p).copies] == [Geometry(0, (6, 4), (1, 6))] * 2


def test_fold_expand_gives_broadcast_dims_zero_stride():
    p = trace({"w": ((3, 1), "float32")}, {"d": ((2, 3, 4), "float32")},
              lambda w, d: d["d"].copy_(w["w"].expand(2, 3, 4)))
    assert one_copy(p).src_geom == Geometry(0, (2, 3, 4), (0, 1, 0))


def test_fold_copy_broadcast_is_an_explicit_expand():
    p = trace({"w": ((4,), "float32")}, {"d": ((3, 4), "float32")}, lambda w, d: d["d"].copy_(w["w"]))
    assert one_copy(p).src_geom == Geometry(0, (3, 4), (0, 1))


def test_fold_reshape_viewable_stays_strided():
    p = trace(W46, {"a": ((2, 2, 6), "float32"), "b": ((2, 3, 4), "float32")}, lambda w, d: (
        d["a"].copy_(w["w"].view(2, 2, 6)),
        # t() is (6, 4) with strides (1, 6): splitting the size-6 dim is still a view.
        d["b"].copy_(w["w"].t().reshape(2, 3, 4)),
    ))
    a, b = fold_views(p).copies
    assert a.src_geom == Geometry(0, (2, 2, 6), (12, 6, 1))
    assert b.src_geom == Geometry(0, (2, 3, 4), (3, 1, 6))


def test_fold_squeeze_unsqueeze_flatten_are_reshapes():
    p = trace({"w": ((1, 4, 1, 6), "float32")}, {"d": ((1, 24), "float32")},
              lambda w, d: d["d"].copy_(w["w"].squeeze(0).squeeze().flatten().unsqueeze(0)))
    assert one_copy(p).src_geom == Geometry(0, (1, 24), (24, 1))


def test_fold_reshape_not_viewable_falls_back_to_replay():
    p = trace(W46, {"d": ((24,), "float32")}, lambda w, d: d["d"].copy_(w["w"].t().reshape(24)))
    copies = fold_views(p).copies
    # Every element is its own run: source order 0, 6, 12, 18, 1, 7, ... into destination 0, 1, 2, ...
    assert len(copies) == 24
    assert all(c.src_geom.shape == (1,) and c.dst_geom.shape == (1,) for c in copies)
    assert [c.src_geom.offset for c in copies] == torch.arange(24).view(4, 6).t().reshape(-1).tolist()
    assert [c.dst_geom.offset for c in copies] == list(range(24))


def test_fold_replay_keeps_contiguous_stretches():
    # permute(1, 0, 2) of (2, 3, 4) is not viewable as (24,), but rows of 4 stay contiguous.
    p = trace({"w": ((2, 3, 4), "float32")}, {"d": ((24,), "float32")},
              lambda w, d: d["d"].copy_(w["w"].permute(1, 0, 2).reshape(-1)))
    copies = fold_views(p).copies
    assert [(c.src_geom.offset, c.dst_geom.offset, c.src_geom.shape) for c in copies] == [
        (0, 0, (4,)), (12, 4, (4,)), (4, 8, (4,)), (16, 12, (4,)), (8, 16, (4,)), (20, 20, (4,))]


def test_fold_contiguous_clone_and_casts():
    p = trace(W46, {"a": ((6, 4), "bfloat16"), "b": ((4, 6), "float32")}, lambda w, d: (
        d["a"].copy_(w["w"].t().contiguous().half()),
        d["b"].copy_(w["w"].clone().to(torch.bfloat16).float()),
    ))
    a, b = fold_views(p).copies
    assert a.src_geom == Geometry(0, (6, 4), (1, 6)) and a.casts == ("float32", "float16", "bfloat16")
    assert b.src_geom == Geometry(0, (4, 6), (6, 1)) and b.casts == ("float32", "bfloat16", "float32")


def test_fold_cat_is_pushed_into_destination_narrows():
    p = trace({"a": ((3, 2), "float32"), "b": ((3, 3), "float32")}, {"d": ((4, 5), "float32")},
              lambda w, d: d["d"][1:].copy_(torch.cat([w["a"], w["b"]], dim=-1)))
    a, b = fold_views(p).copies
    assert (a.src, a.src_geom, a.dst_geom) == ("a", Geometry(0, (3, 2), (2, 1)), Geometry(5, (3, 2), (5, 1)))
    assert (b.src, b.src_geom, b.dst_geom) == ("b", Geometry(0, (3, 3), (3, 1)), Geometry(7, (3, 3), (5, 1)))


def test_fold_view_of_cat_falls_back_to_replay():
    p = trace({"a": ((2,), "float32"), "b": ((2,), "float32")}, {"d": ((2, 2), "float32")},
              lambda w, d: d["d"].t().copy_(torch.cat([w["a"], w["b"]]).view(2, 2)))
    copies = fold_views(p).copies
    # d.t()[i, j] = d[j, i] receives cat[2i + j]: a0->d0, a1->d2, b0->d1, b1->d3.
    got = sorted((c.src, c.src_geom.offset, c.dst_geom.offset, c.src_geom.shape) for c in copies)
    assert got == [("a", 0, 0, (1,)), ("a", 1, 2, (1,)), ("b", 0, 1, (1,)), ("b", 1, 3, (1,))]


def test_fold_replay_of_an_empty_value_emits_nothing():
    p = trace({"a": ((2,), "float32"), "b": ((2,), "float32")}, {"d": ((4,), "float32")}, lambda w, d: (
        d["d"].copy_(torch.cat([w["a"], w["b"]])), d["d"][:0].copy_(torch.cat([w["a"], w["b"]])[2:2])))
    copies = fold_views(p).copies
    assert sum(c.src_geom.numel for c in copies) == 4


# --- lower_runs ----------------------------------------------------------------------------


def test_lower_contiguous_copy_merges_all_dims_into_one_run():
    p = lower_runs(fold_views(trace({"w": ((2, 3, 4), "float32")}, {"d": ((6, 4), "float32")},
                                    lambda w, d: d["d"].view(2, 3, 4).copy_(w["w"]))))
    assert runs_table(p) == [(0, 0, 0, 0, 24, 0)]
    assert p.cast_chains == (("float32",),)


def test_lower_narrowed_destination_gives_one_strided_run_of_rows():
    p = lower_runs(fold_views(trace(W46, {"d": ((4, 10), "float32")},
                                    lambda w, d: d["d"].narrow(1, 2, 6).copy_(w["w"]))))
    assert stored(p) == [(0, 2, 6, 4, 6, 10)]
    assert runs_table(p) == [(0, 0, 0, 2, 6, 0), (0, 6, 0, 12, 6, 0), (0, 12, 0, 22, 6, 0), (0, 18, 0, 32, 6, 0)]


def test_lower_enumerates_dims_outside_the_strided_one():
    # d[:, :2, 1:3] of a (2, 3, 4) tensor: dims 0 and 1 merge on the source side only, so dim 1
    # becomes the run's rows and dim 0 is enumerated.
    p = lower_runs(fold_views(trace({"w": ((2, 2, 2), "float32")}, {"d": ((2, 3, 4), "float32")},
                                    lambda w, d: d["d"][:, :2, 1:3].copy_(w["w"]))))
    assert stored(p) == [(0, 1, 2, 2, 2, 4), (4, 13, 2, 2, 2, 4)]


def test_lower_merges_outer_dims_when_both_sides_continue():
    # Rows 1..2 of w into rows 0..1 of d: (2, 6) is one contiguous stretch on both sides.
    p = lower_runs(fold_views(trace(W46, {"d": ((2, 2, 3), "float32")},
                                    lambda w, d: d["d"].view(2, 6).copy_(w["w"][1:3]))))
    assert runs_table(p) == [(0, 6, 0, 0, 12, 0)]


def test_lower_transposed_source_gives_length_one_runs_in_destination_order():
    p = lower_runs(fold_views(trace(W46, {"d": ((6, 4), "float32")}, lambda w, d: d["d"].copy_(w["w"].t()))))
    assert stored(p)[0] == (0, 0, 1, 4, 6, 1)  # d's row j: w[:, j], elements 6 apart
    rows = runs_table(p)
    assert len(rows) == 24 and {r[4] for r in rows} == {1}
    assert [r[3] for r in rows] == list(range(24))
    assert [r[1] for r in rows] == torch.arange(24).view(4, 6).t().reshape(-1).tolist()


def test_lower_transposed_destination_visits_destination_memory_order():
    p = lower_runs(fold_views(trace(W46, {"d": ((6, 4), "float32")}, lambda w, d: d["d"].t().copy_(w["w"]))))
    rows = runs_table(p)
    assert [r[3] for r in rows] == list(range(24))
    assert [r[1] for r in rows] == torch.arange(24).view(4, 6).t().reshape(-1).tolist()


def test_lower_broadcast_source_repeats_the_row():
    p = lower_runs(fold_views(trace({"w": ((4,), "float32")}, {"d": ((3, 4), "float32")},
                                    lambda w, d: d["d"].copy_(w["w"]))))
    assert stored(p) == [(0, 0, 4, 3, 0, 4)]
    assert runs_table(p) == [(0, 0, 0, 0, 4, 0), (0, 0, 0, 4, 4, 0), (0, 0, 0, 8, 4, 0)]


def test_lower_wire_indexes_distinct_cast_chains():
    p = lower_runs(fold_views(trace({"w": ((4,), "float32")}, {"a": ((4,), "float16"), "b": ((4,), "float16")},
                                    lambda w, d: (d["a"].copy_(w["w"]), d["b"].copy_(w["w"].bfloat16())))))
    assert p.cast_chains == (("float32", "float16"), ("float32", "bfloat16", "float16"))
    assert [r[5] for r in runs_table(p)] == [0, 1]


def test_elementwise_steps_join_the_cast_chain_and_are_never_collapsed():
    """Mamba's A = -exp(A_log.float()): exp and neg commute with views, so they fold into the copy's chain
    (the sender applies them); neg twice is two steps, not one; the chain ends with the wire dtype."""
    p = lower_runs(fold_views(trace({"w": ((4,), "bfloat16")}, {"a": ((2,), "float32"), "b": ((4,), "float32")},
                                    lambda w, d: (d["a"].copy_(-torch.exp(w["w"].float())[2:]),
                                                  d["b"].copy_(-(-w["w"]))))))
    assert p.cast_chains == (("bfloat16", "float32", "exp", "neg", "float32"), ("bfloat16", "neg", "neg", "float32"))
    assert [r[1] for r in runs_table(p)] == [2, 0]


def test_cast_along_applies_steps_in_order_as_eager_torch():
    from weightplan.runtime.casts import cast_along

    x = torch.randn(64, dtype=torch.float32).bfloat16()
    got = cast_along(x, ("bfloat16", "float32", "exp", "neg", "float32"))
    assert torch.equal(got, -torch.exp(x.float()))
    assert torch.equal(cast_along(x, ("bfloat16", "neg", "neg", "float32")), x.float())


def test_strided_runs_ignores_size_one_dims_and_handles_scalars():
    src_off, dst_off, length, count, *_ = strided_runs(Geometry(5, (3, 1, 2), (2, 99, 1)), Geometry(0, (3, 1, 2), (2, 7, 1)))
    assert (src_off.tolist(), dst_off.tolist(), length.tolist(), count.tolist()) == ([5], [0], [6], [1])
    src_off, dst_off, length, count, *_ = strided_runs(Geometry(3, (), ()), Geometry(8, (), ()))
    assert (src_off.tolist(), dst_off.tolist(), length.tolist(), count.tolist()) == ([3], [8], [1], [1])
    src_off, dst_off, length, *_ = strided_runs(Geometry(0, (2, 0), (1, 1)), Geometry(0, (2, 0), (1, 1)))
    assert len(length) == 0


def test_lower_empty_contiguous_copy_gives_no_runs():
    p = trace({"w": ((4,), "float32")}, {"d": ((4,), "float32")}, lambda w, d: (
        d["d"][:2].copy_(w["w"][:2]), d["d"][2:].copy_(w["w"][2:]), d["d"][4:].copy_(w["w"][4:])))
    assert runs_table(run_all(p, check_each=True)) == [(0, 0, 0, 0, 4, 0)]


# --- coalesce ------------------------------------------------------------------------------


def _halves(w_second, dests=None, second_dtype="float32"):
    sources = {"a": ((6,), "float32"), "b": ((6,), "float32")}
    return trace(sources, dests or {"d": ((6,), second_dtype)}, w_second)


def test_coalesce_merges_across_assignments():
    p = lower_runs(fold_views(_halves(lambda w, d: (d["d"][3:].copy_(w["a"][3:]), d["d"][:3].copy_(w["a"][:3])))))
    assert len(p.runs) == 2
    merged = coalesce(p)
    assert runs_table(merged) == [(0, 0, 0, 0, 6, 0)]
    assert descriptors_lower_bound(p.runs) == 1


def test_coalesce_does_not_merge_different_source_tensors():
    # Offsets continue on both sides (a[0:3] -> d[0:3], b[3:6] -> d[3:6]) but the tensors differ.
    p = coalesce(lower_runs(fold_views(_halves(lambda w, d: (d["d"][:3].copy_(w["a"][:3]), d["d"][3:].copy_(w["b"][3:]))))))
    assert runs_table(p) == [(0, 0, 0, 0, 3, 0), (1, 3, 0, 3, 3, 0)]


def test_coalesce_does_not_merge_different_cast_chains():
    p = coalesce(lower_runs(fold_views(_halves(lambda w, d: (d["d"][:3].copy_(w["a"][:3]), d["d"][3:].copy_(w["a"][3:].half()))))))
    assert runs_table(p) == [(0, 0, 0, 0, 3, 0), (0, 3, 0, 3, 3, 1)]
    assert p.cast_chains == (("float32",), ("float32", "float16", "float32"))


def test_coalesce_does_not_merge_different_destinations_or_source_gaps():
    base = Program(sources=(TensorEntry("a", (8,), "float32"),),
                   dests=(TensorEntry("d", (8,), "float32"), TensorEntry("e", (8,), "float32")),
                   cast_chains=(("float32",),))
    runs = make_runs([(0, 0, 0, 0, 2, 0), (0, 2, 1, 2, 2, 0), (0, 5, 0, 2, 2, 0)])
    out = coalesce(dataclasses.replace(base, runs=runs))
    assert sorted(runs_table(out)) == sorted([(0, 0, 0, 0, 2, 0), (0, 5, 0, 2, 2, 0), (0, 2, 1, 2, 2, 0)])


def test_coalesce_sorts_and_merges_long_chains():
    base = Program(sources=(TensorEntry("a", (8,), "float32"),), dests=(TensorEntry("d", (8,), "float32"),),
                   cast_chains=(("float32",),))
    runs = make_runs([(0, 6, 0, 6, 2, 0), (0, 0, 0, 0, 1, 0), (0, 3, 0, 3, 3, 0), (0, 1, 0, 1, 2, 0)])
    out = coalesce(dataclasses.replace(base, runs=runs))
    assert runs_table(out) == [(0, 0, 0, 0, 8, 0)]
    assert descriptors_lower_bound(runs) == 1


def test_coalesce_empty_program_is_unchanged():
    p = Program(sources=(), dests=(), runs=Runs.empty())
    assert coalesce(p) is p


def _strided(rows) -> Runs:
    """Runs from (src_off, dst_off, length, count, src_stride, dst_stride) rows of one stream."""
    cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    zeros = np.zeros(cols.shape[1], dtype=np.int64)
    return Runs(zeros, cols[0], zeros, cols[1], cols[2], zeros, zeros, cols[3], cols[4], cols[5])


def _one_stream(runs: Runs) -> Program:
    return Program(sources=(TensorEntry("w", (64,), "float32"),), dests=(TensorEntry("d", (64,), "float32"),),
                   runs=runs, cast_chains=(("float32",),))


def test_coalesce_joins_strided_runs_that_continue_one_progression():
    # Two experts' column slices: rows 0-2 then rows 3-5 of one progression.
    merged = coalesce(_one_stream(_strided([(8 * 3 + 2, 9, 3, 3, 8, 3), (2, 0, 3, 3, 8, 3)])))
    assert stored(merged) == [(2, 0, 3, 6, 8, 3)]


def test_coalesce_peels_a_strided_row_that_continues_a_plain_run():
    # A plain run src[0:2] -> dst[0:2] is continued on both sides by the first row of a strided run.
    merged = coalesce(_one_stream(_strided([(0, 0, 2, 1, 0, 0), (2, 2, 3, 3, 10, 5)])))
    assert stored(merged) == [(0, 0, 5, 1, 0, 0), (12, 7, 3, 2, 10, 5)]
    assert descriptors_lower_bound(_strided([(0, 0, 2, 1, 0, 0), (2, 2, 3, 3, 10, 5)])) == merged.runs.rows == 3


def test_coalesce_takes_interleaved_strided_runs_row_by_row():
    # Left and right halves of four 4-element rows, copied by two strided runs: one contiguous run.
    merged = coalesce(_one_stream(_strided([(0, 0, 2, 4, 4, 4), (2, 2, 2, 4, 4, 4)])))
    assert stored(merged) == [(0, 0, 16, 1, 0, 0)]


def test_verify_rejects_malformed_strided_runs():
    overlapping_rows = _one_stream(_strided([(0, 0, 4, 2, 4, 2)]))
    with pytest.raises(PlanInvariantError, match="malformed strided run"):
        verify(overlapping_rows, require_full_coverage=False)
    strided_plain = _one_stream(_strided([(0, 0, 4, 1, 4, 4)]))
    with pytest.raises(PlanInvariantError, match="malformed strided run"):
        verify(strided_plain, require_full_coverage=False)
    past_the_end = _one_stream(_strided([(0, 0, 4, 9, 4, 8)]))
    with pytest.raises(PlanInvariantError, match="destination run out of bounds"):
        verify(past_the_end, require_full_coverage=False)


# --- verify --------------------------------------------------------------------------------


def _program(rows, *, src_shape=(8,), dst_shape=(8,), chain=("float32",), dst_dtype="float32"):
    return Program(
        sources=(TensorEntry("trainer.w", src_shape, "float32"),),
        dests=(TensorEntry("model.layers.0.w", dst_shape, dst_dtype),),
        runs=make_runs(rows),
        cast_chains=(chain,),
    )


def test_verify_accepts_a_full_plan():
    coverage = verify(_program([(0, 0, 0, 0, 4, 0), (0, 4, 0, 4, 4, 0)]))
    assert coverage.fraction == 1.0 and coverage.uncovered == ()


def test_verify_destination_out_of_bounds_names_the_tensor():
    with pytest.raises(PlanInvariantError, match=r"destination run out of bounds: model\.layers\.0\.w .*\[6, 10\)"):
        verify(_program([(0, 0, 0, 6, 4, 0)]), require_full_coverage=False)


def test_verify_source_out_of_bounds_names_the_tensor():
    with pytest.raises(PlanInvariantError, match=r"source run out of bounds: trainer\.w"):
        verify(_program([(0, 6, 0, 0, 4, 0)]), require_full_coverage=False)
    with pytest.raises(PlanInvariantError, match=r"source run out of bounds: trainer\.w"):
        verify(_program([(0, -1, 0, 0, 2, 0)]), require_full_coverage=False)


def test_verify_rejects_non_positive_lengths():
    with pytest.raises(PlanInvariantError, match="non-positive length"):
        verify(_program([(0, 0, 0, 0, 0, 0)]), require_full_coverage=False)


def test_verify_destination_element_written_twice_names_the_tensor():
    with pytest.raises(PlanInvariantError, match=r"written twice: model\.layers\.0\.w element 3"):
        verify(_program([(0, 0, 0, 0, 4, 0), (0, 0, 0, 3, 2, 0)]), require_full_coverage=False)
    # A run swallowed by an earlier, longer one is an overlap too.
    with pytest.raises(PlanInvariantError, match=r"written twice: model\.layers\.0\.w element 2"):
        verify(_program([(0, 0, 0, 2, 1, 0), (0, 0, 0, 0, 8, 0)]), require_full_coverage=False)


def test_verify_rejects_a_cast_chain_that_does_not_reach_the_destination_dtype():
    with pytest.raises(PlanInvariantError, match=r"does not lead from trainer\.w \(float32\) to model\.layers\.0\.w \(bfloat16\)"):
        verify(_program([(0, 0, 0, 0, 8, 0)], dst_dtype="bfloat16"))


def test_verify_partial_coverage():
    p = _program([(0, 0, 0, 0, 2, 0)])
    with pytest.raises(PlanInvariantError, match=r"not fully written .*model\.layers\.0\.w"):
        verify(p)
    coverage = verify(p, require_full_coverage=False)
    assert (coverage.dst_bytes, coverage.written_once_bytes, coverage.uncovered) == (32, 8, ("model.layers.0.w",))
    assert coverage.fraction == 0.25


def test_verify_needs_runs():
    with pytest.raises(PlanInvariantError, match="lower_runs first"):
        verify(Program(sources=(), dests=()))


def test_descriptors_lower_bound_counts_runs_nothing_continues():
    runs = make_runs([(0, 0, 0, 0, 2, 0), (0, 2, 0, 2, 2, 0), (0, 5, 0, 4, 1, 0), (0, 6, 0, 5, 1, 1)])
    assert descriptors_lower_bound(runs) == 3
    assert descriptors_lower_bound(Runs.empty()) == 0


# --- pipeline ------------------------------------------------------------------------------


def test_pipeline_runs_the_passes_in_order_and_stage_by_stage():
    p = trace(W46, {"d": ((4, 6), "float32")}, lambda w, d: (d["d"][2:].copy_(w["w"][2:]), d["d"][:2].copy_(w["w"][:2])))
    timings = {}
    full = run_all(p, check_each=True, observe=timer(timings))
    assert list(timings) == ["fold_views", "lower_runs", "lower_constants", "expand_layers", "merge_ranks", "split_shards",
                             "coalesce", "check_coverage"]  # place_quant applies to fp8 programs only
    assert runs_table(full) == [(0, 0, 0, 0, 24, 0)]
    lowered = run_stage(Stage.PER_RANK, p)
    assert len(lowered.runs) == 2
    assert runs_table(run_stage(Stage.WHOLE_PLAN, join_ranks([lowered], lowered.cast_chains))) == runs_table(full)
