"""expert_templates: each MoE layer's middle experts derived from its first two; plans equal to feeding every expert to vLLM."""

from __future__ import annotations

import functools

import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend import expert_templates
from weightplan.compiler.frontend.expert_templates import ExpertTemplates
from weightplan.compiler.ir import Assignment, Geometry, Node, Op

from ..conftest import config_dir

CASES = [  # (case, routed experts derived per traced MoE layer and checkpoint suffix)
    (("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "tp=1"), 5),  # 8 local experts: 0, 1 and 7 fed
    (("tiny-qwen3-moe", "hf", "bf16", "fsdp=2", "tp=2"), 5),  # per-expert trainer names: the numbers in them move
    (("tiny-glm", "hf", "bf16", "fsdp=2", "dp=2,ep"), 1),  # 4 local experts per rank (EP): 0, 1 and 3 fed, 2 derived
]


def _compile(tmp_path, monkeypatch, case, name, **tracer):
    from weightplan.compiler import compile as compile_module
    from weightplan.compiler.frontend.rank_models import RankTracer

    monkeypatch.setattr(compile_module, "RankTracer", functools.partial(RankTracer, **tracer))
    model, fmt, dtype, trainer, inference = case
    result = compile_plan(CompileOptions(str(config_dir(model)), fmt, dtype, "none", tmp_path / name, trainer=trainer,
                                         inference=inference))
    monkeypatch.undo()
    return (tmp_path / name).read_bytes(), result.stats


@pytest.mark.parametrize("case,per_group", CASES)
def test_derived_experts_give_the_plan_of_feeding_every_expert(tmp_path, monkeypatch, case, per_group):
    fed, fed_stats = _compile(tmp_path, monkeypatch, case, "fed.plan", derive_experts=False)
    derived, stats = _compile(tmp_path, monkeypatch, case, "derived.plan")
    assert fed_stats["expert_names_derived"] == 0
    assert stats["expert_names_derived"] > 0 and stats["expert_names_derived"] % per_group == 0
    assert derived == fed


def test_a_failing_guard_feeds_every_expert(tmp_path, monkeypatch):
    """Experts 0, 1, 2, 3, 5 listed as a layer's local ones: expert 5 (the guard) is not where experts 0 and 1 put
    the fifth, so the trace feeds every name again and derives none."""
    case = CASES[0][0]
    fed, _ = _compile(tmp_path, monkeypatch, case, "fed.plan", derive_experts=False)
    real_init = ExpertTemplates.__init__

    def skewed(self, model):
        real_init(self, model)
        self.local = {layer: [0, 1, 2, 3, 5] for layer in self.local}
        self.position = {layer: {e: i for i, e in enumerate(experts)} for layer, experts in self.local.items()}

    monkeypatch.setattr(ExpertTemplates, "__init__", skewed)
    plan, stats = _compile(tmp_path, monkeypatch, case, "guarded.plan")
    assert stats["expert_names_derived"] == 0
    assert plan == fed


def _templates(layer: str, experts: list[int]) -> ExpertTemplates:
    t = object.__new__(ExpertTemplates)
    t.local, t.position, t.names_derived = {layer: experts}, {layer: {e: i for i, e in enumerate(experts)}}, 0
    return t


def _write(expert: int, slot: int, name: str | None = None) -> Assignment:
    name = name or f"m.experts.{expert}.w.weight"
    source = Node(Op.SOURCE, (name,), (), (4,), "bfloat16")
    return Assignment("m.experts.w", Geometry(slot * 4, (4,), (1,)), source, name)


def test_complete_puts_derived_blocks_in_stream_order():
    names = [f"m.experts.{e}.w.weight" for e in range(6)]
    t = _templates("m", list(range(6)))
    assert [t.derived(n) for n in names] == [False, False, True, True, True, False]
    fed = [_write(e, e) for e in (0, 1, 5)]
    assert t.complete(fed, names, {names[2], names[3], names[4]}) == [_write(e, e) for e in range(6)]


def test_complete_refuses_writes_of_one_name_that_are_not_contiguous():
    names = [f"m.experts.{e}.w.weight" for e in range(4)] + ["m.norm.weight"]
    t = _templates("m", list(range(4)))
    norm = _write(0, 9, "m.norm.weight")
    late = [_write(0, 0), _write(1, 1), norm, _write(3, 3), _write(0, 8)]  # expert 0 written again after others
    assert t.complete(late, names, {names[2]}) is None


def test_complete_refuses_a_guard_off_the_line():
    names = [f"m.experts.{e}.w.weight" for e in range(4)]
    t = _templates("m", list(range(4)))
    assert t.complete([_write(0, 0), _write(1, 1), _write(3, 4)], names, {names[2]}) is None


def test_a_layer_with_fewer_than_four_local_experts_is_fed_whole(tmp_path, monkeypatch):
    assert expert_templates.MIN_LOCAL_EXPERTS == 4
    _, stats = _compile(tmp_path, monkeypatch, ("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep"), "p.plan")
    assert stats["expert_names_derived"] == 0  # 2 of the 8 experts on each rank
