"""runtime/plan/invariants.py: the stride and bounds rules the plan reader and the compiler's verify share."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from weightplan.compiler.passes.verify import PlanInvariantError, verify
from weightplan.compiler.plan_summary import as_program
from weightplan.runtime import PlanFormatError, load_plan
from weightplan.runtime.plan import invariants
from weightplan.runtime.plan.columns import Runs
from weightplan.runtime.plan.format import decode_plan, encode_plan
from weightplan.runtime.plan.invariants import first_out_of_bounds, malformed_strides


def _runs(rows) -> Runs:
    """Runs of one source and one destination from (src_off, dst_off, length, count, src_stride, dst_stride) rows."""
    cols = np.array(rows, dtype=np.int64).reshape(-1, 6).T
    zeros = np.zeros(cols.shape[1], dtype=np.int64)
    return Runs(zeros, cols[0], zeros, cols[1], cols[2], zeros, zeros, cols[3], cols[4], cols[5])


def test_stride_rules():
    runs = _runs([
        (0, 0, 4, 1, 0, 0),  # plain: fine
        (0, 0, 4, 3, 8, 8),  # strided, disjoint rows: fine
        (0, 0, 4, 0, 0, 0),  # count below 1
        (0, 0, 4, 1, 8, 0),  # strides on a one-row run
        (0, 0, 4, 2, -1, 8),  # negative source stride
        (0, 0, 4, 2, 8, 3),  # destination rows overlap
    ])
    assert malformed_strides(runs).tolist() == [2, 3, 4, 5]


def test_bounds_rule_counts_every_row_of_a_strided_run():
    runs = _runs([(0, 0, 4, 1, 0, 0), (0, 0, 4, 3, 8, 8)])  # the strided run ends at element 20 on both sides
    limit = np.array([20, 20])
    assert first_out_of_bounds(runs, limit, limit) == ("", -1)
    assert first_out_of_bounds(runs, limit, np.array([20, 19])) == ("destination", 1)
    assert first_out_of_bounds(runs, np.array([3, 20]), np.array([20, 19])) == ("source", 0)
    assert first_out_of_bounds(dataclasses.replace(runs, dst_off=np.array([-1, 0])), limit, limit) == ("destination", 0)


@pytest.fixture
def spied(monkeypatch):
    """Record what invariants.first_out_of_bounds answers, whoever calls it."""
    answers = []
    real = invariants.first_out_of_bounds

    def spy(*args):
        answers.append(real(*args))
        return answers[-1]

    monkeypatch.setattr(invariants, "first_out_of_bounds", spy)
    return answers


def test_an_out_of_bounds_strided_run_is_refused_by_the_reader_and_by_verify_alike(plan_cache, spied):
    plan = load_plan(plan_cache("tiny-llama", "hf", "fp32"))
    spied.clear()  # compiling and loading the good plan asked too
    t = plan.table
    i = int(np.argmax(t.length))  # a run into a tensor: make it a strided run whose last row ends past it
    numel = plan.dests[int(t.dest[i])].numel
    count = np.ones_like(t.count)
    count[i] = 2
    bad = dataclasses.replace(t, count=count, src_stride=np.where(count > 1, t.length, 0),
                              dst_stride=np.where(count > 1, numel + 1, 0))
    assert malformed_strides(bad).tolist() == []  # well-formed strides, only out of bounds

    with pytest.raises(PlanFormatError, match="a run reaches outside its"):
        decode_plan(encode_plan(plan.header, bad), "bad")
    with pytest.raises(PlanInvariantError, match="run out of bounds"):
        verify(dataclasses.replace(as_program(plan), runs=bad))
    assert len(spied) == 2 and spied[0] == spied[1] and spied[0][1] == i
