"""split_expert_slots: every run into an EPLB expert tensor lies inside one physical slot, copying the same bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightplan.compiler.ir import PlanOrigin, Program, Runs, TensorEntry
from weightplan.compiler.passes.pipeline import (PIPELINE, Fact, PassCheckError, Stage, check, check_slot_aligned, passes,
                                                 run_all, run_stage)
from weightplan.compiler.passes.split_expert_slots import misaligned_runs, slot_sizes, split_expert_slots
from weightplan.runtime.plan.header import EplbHeader, InferenceHeader, TrainerHeader
from weightplan.runtime.plan.invariants import malformed_strides

from ..support.pipeline_runs import timer
from ..support.tracing import runs_table, trace

EXPERT = TensorEntry("layers.0.experts.w13", (4, 2, 4), "float32")  # 4 local slots of 8 elements
DENSE = TensorEntry("layers.0.attn.qkv", (64,), "float32")
SOURCE = TensorEntry("w", (256,), "float32")


def origin(layers=((EXPERT.name,),), eplb=True) -> PlanOrigin:
    header = InferenceHeader("tp1-dp2-ep-eplb2", 1, 2, True, "cuda",
                             eplb=EplbHeader(6, 2, tuple(layers)) if eplb else None)
    return PlanOrigin(vllm_version="test", model="test", config_sha256="", architecture="none",
                      trainer=TrainerHeader("hf", "bf16", "fsdp1", ()), inference=header, quant="none", src_ranks=1,
                      dst_ranks=2)


def program(rows, dests=(EXPERT, DENSE), eplb=True) -> Program:
    """A program whose runs are (dest, src_off, dst_off, length, count, src_stride, dst_stride) rows from source 0."""
    cols = np.array(rows, dtype=np.int64).reshape(-1, 7).T
    zeros = np.zeros(cols.shape[1], dtype=np.int64)
    runs = Runs(src=zeros, src_off=cols[1], dest=cols[0], dst_off=cols[2], length=cols[3], wire=zeros, src_rank=zeros,
                count=cols[4], src_stride=cols[5], dst_stride=cols[6])
    return Program((SOURCE,), tuple(dests), runs=runs, origin=origin(eplb=eplb), cast_chains=(("float32",),))


def rows_of(p: Program) -> list[tuple[int, ...]]:
    r = p.runs
    return list(zip(*(getattr(r, f).tolist() for f in ("dest", "src_off", "dst_off", "length", "count", "src_stride",
                                                         "dst_stride"))))


def pairs(runs: Runs) -> np.ndarray:
    """Every (src, src_rank, wire, dest, source element, destination element) a run table copies, sorted."""
    rows = runs.expand()
    per = np.repeat(np.arange(len(rows)), rows.length)
    at = np.arange(len(per)) - np.repeat(np.cumsum(rows.length) - rows.length, rows.length)
    table = np.stack([rows.src[per], rows.src_rank[per], rows.wire[per], rows.dest[per], rows.src_off[per] + at,
                      rows.dst_off[per] + at], axis=1)
    return table[np.lexsort(table.T[::-1])] if len(table) else table.reshape(0, 6)


def test_slot_sizes_are_the_expert_tensors_rows_and_zero_elsewhere():
    assert slot_sizes(program([])).tolist() == [8, 0]
    assert slot_sizes(program([], eplb=False)).tolist() == [0, 0]


def test_a_plain_run_over_three_slots_is_cut_at_each_boundary():
    p = split_expert_slots(program([(0, 100, 6, 12, 1, 0, 0)]))
    assert rows_of(p) == [(0, 100, 6, 2, 1, 0, 0), (0, 102, 8, 8, 1, 0, 0), (0, 110, 16, 2, 1, 0, 0)]


def test_a_strided_run_whose_rows_lie_in_two_slots_becomes_one_strided_run_per_slot():
    # rows of 2 elements every 4: rows 0, 1 in slot 0, rows 2, 3 in slot 1
    p = split_expert_slots(program([(0, 0, 0, 2, 4, 10, 4)]))
    assert rows_of(p) == [(0, 0, 0, 2, 2, 10, 4), (0, 20, 8, 2, 2, 10, 4)]


def test_rows_crossing_a_boundary_are_cut_and_the_rows_inside_keep_their_stride():
    # rows of 3 every 5 from element 0 (slots of 8): 0-2, 5-7 | 10-12, 15-17 (cut at 16) | 20-22 | 25-27
    p = split_expert_slots(program([(0, 0, 0, 3, 6, 3, 5)]))
    assert sorted(rows_of(p), key=lambda r: r[2]) == [
        (0, 0, 0, 3, 2, 3, 5),  # slot 0: rows 0 and 1, still one strided run
        (0, 6, 10, 3, 1, 0, 0), (0, 9, 15, 1, 1, 0, 0),  # slot 1: row 2, and row 3's first element
        (0, 10, 16, 2, 1, 0, 0), (0, 12, 20, 3, 1, 0, 0),  # slot 2: the rest of row 3, row 4
        (0, 15, 25, 3, 1, 0, 0)]  # slot 3: row 5
    assert not len(misaligned_runs(p))
    assert (pairs(p.runs) == pairs(program([(0, 0, 0, 3, 6, 3, 5)]).runs)).all()


def test_runs_into_other_tensors_and_runs_inside_one_slot_are_untouched_and_order_is_kept():
    rows = [(1, 0, 0, 64, 1, 0, 0), (0, 64, 0, 16, 1, 0, 0), (0, 200, 17, 5, 1, 0, 0), (1, 300, 0, 1, 1, 0, 0)]
    p = split_expert_slots(program(rows))
    assert rows_of(p) == [rows[0], (0, 64, 0, 8, 1, 0, 0), (0, 72, 8, 8, 1, 0, 0), rows[2], rows[3]]


def test_a_program_without_eplb_is_returned_as_is():
    p = program([(0, 100, 6, 12, 1, 0, 0)], eplb=False)
    assert split_expert_slots(p) is p


def test_the_check_names_the_first_run_crossing_a_slot():
    p = program([(0, 0, 0, 8, 1, 0, 0), (0, 100, 12, 8, 1, 0, 0)])
    with pytest.raises(PassCheckError, match=r"^1 runs cross an EPLB slot boundary; the first writes layers\.0\.experts\.w13 "
                                             r"at element 12 \(1 rows of 8, stride 0\)"):
        check_slot_aligned(p)
    with pytest.raises(PassCheckError, match="EPLB slot boundary"):
        check(p, frozenset({Fact.SLOT_ALIGNED}))
    check_slot_aligned(split_expert_slots(p))


def test_the_pass_is_declared_in_its_own_stage_between_the_whole_plan_and_quant():
    (step,) = passes(Stage.EPLB)
    assert step.run is split_expert_slots and step.checked
    assert step.requires == {Fact.COVERED} and step.ensures == {Fact.SLOT_ALIGNED}
    order = list(Stage)
    assert order.index(Stage.WHOLE_PLAN) < order.index(Stage.EPLB) < order.index(Stage.QUANT)
    assert PIPELINE.index(step) == [p.name for p in PIPELINE].index("place_quant") - 1
    assert step.applies(program([])) and not step.applies(program([], eplb=False))
    assert not step.applies(dataclasses.replace(program([]), origin=None))


def _traced(eplb: bool) -> Program:
    p = trace({"w": ((2, 3, 4), "float32")}, {"e": ((2, 3, 4), "float32")},
              lambda w, d: (d["e"][1].copy_(w["w"][1]), d["e"][0].copy_(w["w"][0])))
    return dataclasses.replace(p, origin=origin(layers=(("e",),), eplb=eplb))


@pytest.mark.parametrize("eplb", (True, False), ids=("eplb", "no-eplb"))
def test_run_all_runs_the_eplb_stage_after_coalesce_on_eplb_programs_only(eplb):
    timings = {}
    full = run_all(_traced(eplb), check_each=True, observe=timer(timings))
    assert ("split_expert_slots" in timings) == eplb
    if eplb:
        assert list(timings)[-2:] == ["check_coverage", "split_expert_slots"]
        assert runs_table(full) == [(0, 0, 0, 0, 12, 0), (0, 12, 0, 12, 12, 0)]  # coalesced, then cut at the slot
    else:
        assert runs_table(full) == [(0, 0, 0, 0, 24, 0)]


def test_run_stage_refuses_the_eplb_stage_without_coverage():
    with pytest.raises(PassCheckError, match="requires covered"):
        run_stage(Stage.EPLB, program([(0, 0, 0, 8, 1, 0, 0)]), facts=frozenset())


SLOTS, SLOT = 5, 6  # the expert tensor: 5 slots of 6 elements (shape (5, 2, 3)); the dense one: 64 elements
EXPERT_5 = TensorEntry("experts.w2", (SLOTS, 2, 3), "bfloat16")


@st.composite
def run_rows(draw):
    """A valid run (dest, src_off, dst_off, length, count, src_stride, dst_stride, src, src_rank, wire) in bounds."""
    dest = draw(st.integers(0, 1))
    size = SLOTS * SLOT if dest == 0 else 64
    length = draw(st.integers(1, min(size, 14)))
    count = draw(st.integers(1, max(1, min(6, size // length))))
    dst_stride = draw(st.integers(length, max(length, (size - length) // max(count - 1, 1)))) if count > 1 else 0
    if count > 1 and dst_stride == length:
        src_stride = draw(st.integers(0, 20).filter(lambda s: s != length))  # no strided run that is one stretch
    else:
        src_stride = draw(st.integers(0, 20)) if count > 1 else 0
    dst_off = draw(st.integers(0, size - ((count - 1) * dst_stride + length)))
    return (dest, draw(st.integers(0, 100)), dst_off, length, count, src_stride, dst_stride, draw(st.integers(0, 2)),
            draw(st.integers(0, 3)), draw(st.integers(0, 1)))


@settings(max_examples=300, deadline=None)
@given(st.lists(run_rows(), max_size=12))
def test_split_runs_copy_the_same_bytes_inside_one_slot_each_and_leave_other_tensors_alone(rows):
    cols = np.array(rows, dtype=np.int64).reshape(-1, 10).T
    runs = Runs(src=cols[7], src_off=cols[1], dest=cols[0], dst_off=cols[2], length=cols[3], wire=cols[9],
                src_rank=cols[8], count=cols[4], src_stride=cols[5], dst_stride=cols[6])
    before = Program((SOURCE, SOURCE, SOURCE), (EXPERT_5, DENSE), runs=runs,
                     origin=origin(layers=((EXPERT_5.name,),)))
    after = split_expert_slots(before).runs
    assert (pairs(after) == pairs(runs)).all() and len(pairs(after)) == len(pairs(runs))
    assert not len(misaligned_runs(dataclasses.replace(before, runs=after)))
    assert not len(malformed_strides(after))
    dense = lambda r: r.take(np.flatnonzero(r.dest == 1)).columns()  # noqa: E731
    assert {k: v.tolist() for k, v in dense(after).items()} == {k: v.tolist() for k, v in dense(runs).items()}
    per = np.maximum(slot_sizes(before)[after.dest], 1)
    inside = (after.dest == 1) | (after.dst_off // per == (after.dst_end() - 1) // per)
    assert inside.all()
