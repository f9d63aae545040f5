"""extrapolate: a TP rank's traced load from ranks 0 and 1, every integer moved by its step, anything else refused."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from weightplan.compiler.frontend.extrapolate import Line, NotAffine, extrapolate
from weightplan.compiler.ir import Assignment, Geometry, Node, Op


def _load(rank: int, base: int, step: int, rows: int, source: str = "model.layers.0.mlp.down_proj.weight"):
    """The assignment vLLM's RowParallelLinear traces for `rank`: a column slice of the source into the whole shard."""
    src = Node(Op.SOURCE, (source,), (), (rows, 64), "bfloat16")
    sliced = Node(Op.SLICE, (1, base + rank * step, step, 1), (src,), (rows, step), "bfloat16")
    return [Assignment("model.layers.0.mlp.down_proj.weight", Geometry.contiguous((rows, step)), sliced, source),
            Assignment("model.norm.weight", Geometry(base + rank * rows, (rows,), (1,)), src, source)]


@given(base=st.integers(0, 1 << 40), step=st.integers(-(1 << 20), 1 << 20), rows=st.integers(1, 64), rank=st.integers(0, 127))
def test_every_integer_moves_by_its_step(base, step, rows, rank):
    assert extrapolate(_load(0, base, step, rows), _load(1, base, step, rows), rank) == _load(rank, base, step, rows)


def test_what_does_not_move_stays_the_same_object():
    first, second = _load(0, 0, 16, 8), _load(1, 0, 16, 8)
    third = extrapolate(first, second, 2)
    assert third[0].node.inputs[0] is first[0].node.inputs[0]  # the source node: equal in both, not copied
    assert third[0].geometry is first[0].geometry
    assert third[0].node is not first[0].node


def test_a_node_shared_by_two_assignments_stays_shared():
    def load(rank):
        node = Node(Op.SLICE, (0, rank * 4, 4, 1), (Node(Op.SOURCE, ("w",), (), (16,), "float32"),), (4,), "float32")
        return [Assignment("a", Geometry.contiguous((4,)), node, "w"), Assignment("b", Geometry.contiguous((4,)), node, "w")]

    out = extrapolate(load(0), load(1), 3)
    assert out == load(3) and out[0].node is out[1].node


@pytest.mark.parametrize("second,why", [
    (lambda load: load[:1], "items"),  # another number of assignments
    (lambda load: [Assignment("other", load[0].geometry, load[0].node, load[0].loading), load[1]], "other"),  # another name
    (lambda load: [load[0], Assignment(load[1].dest, load[1].geometry,
                                       Node(Op.CAST, ("float32",), (load[1].node,), load[1].node.shape, "float32"), load[1].loading)],
     "Op"),  # another op
    (lambda load: [load[0], Assignment(load[1].dest, load[1].geometry, load[1].node, "model.layers.1.x")], "model.layers"),
])
def test_anything_but_an_integer_that_differs_is_refused(second, why):
    first = _load(0, 0, 16, 8)
    with pytest.raises(NotAffine, match=why):
        extrapolate(first, second(_load(1, 0, 16, 8)), 2)


def test_floats_bools_and_types_must_be_equal():
    with pytest.raises(NotAffine):
        extrapolate((1, 0.5), (2, 0.25), 2)
    with pytest.raises(NotAffine):
        extrapolate((True,), (False,), 2)
    with pytest.raises(NotAffine, match="int against str"):
        extrapolate((1,), ("1",), 2)
    assert extrapolate((1, 0.5, None, frozenset({"a"})), (3, 0.5, None, frozenset({"a"})), 4) == (9, 0.5, None, frozenset({"a"}))


def test_numbers_in_names_move_and_the_text_around_them_must_agree():
    assert extrapolate("model.layers.3.mlp.experts.8.w1", "model.layers.3.mlp.experts.10.w1", 3) == "model.layers.3.mlp.experts.14.w1"
    with pytest.raises(NotAffine):
        extrapolate("experts.8.gate_proj", "experts.9.up_proj", 2)  # other text
    with pytest.raises(NotAffine):
        extrapolate("experts.08.w", "experts.09.w", 2)  # zero-padded: its width could change
    with pytest.raises(NotAffine, match="would be -1"):
        extrapolate("experts.1.w", "experts.0.w", 2)


def test_a_line_builds_every_step_from_one_comparison():
    line = Line(_load(0, 5, 16, 8), _load(1, 5, 16, 8))
    assert [line(k) for k in (7, 0, 3)] == [_load(k, 5, 16, 8) for k in (7, 0, 3)]
