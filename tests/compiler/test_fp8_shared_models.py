"""fp8 with one model per TP rank: plans byte-identical to one fresh model per rank, and each shortcut of the shared
path (snapshot/restore, post-load reuse across DP ranks and identical layers, other ranks' experts not fed) checked."""

from __future__ import annotations

import functools
import json

import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

from ..conftest import config_dir

FP8 = "fp8_per_block"

CASES = {
    "glm-ep": ("fp8-glm", "stacked", "fsdp=4,ep=2", "dp=4,ep"),  # one local expert per rank
    "deepseek-tp-dp-ep": ("fp8-deepseek-v3", "hf", "fsdp=2", "tp=2,dp=2,ep"),  # two TP ranks, each shared
    "glm-dp-no-ep": ("fp8-glm", "hf", "fsdp=2", "dp=4"),  # no EP: every rank holds a TP slice of every expert
    "glm-6-layers": ("fp8-glm-6", "stacked", "fsdp=4,ep=2", "dp=4,ep"),  # MoE layers 1-5: post-load layer reuse
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Config directories by name; fp8-glm-6 is fp8-glm with 6 layers, so one layer class has members between."""
    root = tmp_path_factory.mktemp("configs")
    config = json.loads((config_dir("fp8-glm") / "config.json").read_text())
    (root / "fp8-glm-6").mkdir()
    (root / "fp8-glm-6" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6}))
    return lambda name: root / name if name == "fp8-glm-6" else config_dir(name)


def _compile(configs, tmp_path, monkeypatch, case: str, name: str, **tracer):
    from weightplan.compiler import compile as compile_module
    from weightplan.compiler.frontend.rank_models import RankTracer

    model, fmt, trainer, inference = CASES[case]
    out = tmp_path / name
    with monkeypatch.context() as patch:
        patch.setattr(compile_module, "RankTracer", functools.partial(RankTracer, **tracer))
        result = compile_plan(CompileOptions(str(configs(model)), fmt, "bf16", FP8, out, trainer=trainer, inference=inference))
    return out, result.stats


@pytest.fixture(scope="module")
def shared(configs, tmp_path_factory):
    """case -> (plan path, stats) compiled with sharing (the default), once per module."""
    root = tmp_path_factory.mktemp("shared")
    cache = {}

    def get(case: str):
        if case not in cache:
            model, fmt, trainer, inference = CASES[case]
            result = compile_plan(CompileOptions(str(configs(model)), fmt, "bf16", FP8, root / f"{case}.plan",
                                                 trainer=trainer, inference=inference))
            cache[case] = (result.path, result.stats)
        return cache[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_models_give_the_plan_of_real_builds(shared, configs, tmp_path, monkeypatch, case):
    path, stats = shared(case)
    real, real_stats = _compile(configs, tmp_path, monkeypatch, case, "real.plan", share=False)
    ranks = load_plan(path).header.dst_ranks
    assert real_stats["models_built"] == real_stats["post_load_traces"] == ranks and real_stats["guard"] == "off"
    assert stats["guard"] == f"passed (rank {ranks - 1})"
    tp = 2 if "tp=2" in CASES[case][3] else 1
    # one model per TP rank plus the guard's real build; post-load traced once per shared model plus the guard's
    assert stats["models_built"] == stats["post_load_traces"] == tp + 1
    # with EP, shared models are fed only their own experts' checkpoint names; real builds get all of them
    assert (stats["names_skipped"] > 0) == CASES[case][3].endswith(",ep") and real_stats["names_skipped"] == 0
    assert path.read_bytes() == real.read_bytes()
    assert stats["descriptors"] == stats["descriptors_lower_bound"]  # bound over the runs that stay runs


@pytest.mark.parametrize("case", sorted(CASES))
def test_shared_fp8_plan_matches_vllm_on_every_rank(shared, configs, case):
    path, _ = shared(case)
    plan = load_plan(path)
    result = verify_plan(path, model=str(configs(CASES[case][0])), seed=4)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests)


def test_every_dp_rank_post_loads_like_its_tp_rank(configs, tmp_path, monkeypatch):
    """What sharing reuses: each rank's post-load result, traced on its own real build, equals its TP rank's DP rank 0."""
    from weightplan.compiler.quant_compile import QuantHooks

    seen = []
    original = QuantHooks.collect
    monkeypatch.setattr(QuantHooks, "collect", lambda self, post: (seen.append(post), original(self, post)))
    _compile(configs, tmp_path, monkeypatch, "deepseek-tp-dp-ep", "real.plan", share=False)
    assert len(seen) == 4 and seen[0].tensors and seen[0].derived
    assert seen[2] == seen[0] and seen[3] == seen[1]  # rank = dp_rank * tp + tp_rank


def test_guard_catches_a_post_load_that_differs_on_the_guard_rank(shared, configs, tmp_path, monkeypatch):
    from weightplan.compiler.quant_compile import QuantHooks

    original = QuantHooks.post_load
    calls = []

    def post_load(self, model, classes, *, keep_model):
        post = original(self, model, classes, keep_model=keep_model)
        calls.append(keep_model)
        if calls.count(False) == 1 and not keep_model:  # the guard's real build: drop one quantized tensor
            post = type(post)(post.tensors[:-1], post.derived)
        return post

    monkeypatch.setattr(QuantHooks, "post_load", post_load)
    plan, stats = _compile(configs, tmp_path, monkeypatch, "glm-ep", "guarded.plan")
    assert stats["guard"].startswith("failed (rank 3)")
    assert stats["models_built"] == 4
    # the dropped tensor is found again on the other ranks' real builds, so the plan is still the right one
    assert plan.read_bytes() == shared("glm-ep")[0].read_bytes()


def test_guard_catches_a_model_that_was_not_re_pointed(shared, configs, tmp_path, monkeypatch):
    from weightplan.compiler.frontend import rank_models

    monkeypatch.setattr(rank_models, "place_experts", lambda *args, **kwargs: 0)  # "re-points" nothing
    plan, stats = _compile(configs, tmp_path, monkeypatch, "glm-ep", "guarded.plan")
    assert stats["guard"].startswith("failed (rank 3)")
    assert plan.read_bytes() == shared("glm-ep")[0].read_bytes()


def _model(config):
    from weightplan.compiler.frontend.vllm_patches import triton_fp8_kernels
    from weightplan.compiler.frontend.fp8_trace import unwrap_online_loaders
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

    vllm_config = make_vllm_config(config, quantization=FP8)
    with triton_fp8_kernels():
        model = build_model(vllm_config)
    unwrap_online_loaders(model)
    return model


def _state(model):
    """Everything the post-load step could change, as comparable values (objects by identity)."""
    from weightplan.compiler.frontend.fp8_trace import quantized_modules

    state = [(name, id(p), p.dtype, tuple(p.shape)) for name, p in model.named_parameters()]
    for name, module in quantized_modules(model):
        for owner in (module, module.quant_method):
            attrs = {k: id(v) for k, v in vars(owner).items()}
            inner = {k: {n: id(x) for n, x in v.items()} for k, v in vars(owner).items() if k in ("_parameters", "_buffers", "_modules")}
            state.append((name, type(owner).__name__, attrs, inner))
    return state


def _post_load(model, classes=None, *, keep_model=False):
    from weightplan.compiler.frontend.vllm_patches import triton_fp8_kernels
    from weightplan.compiler.frontend.post_load import trace_rank_post_load

    with triton_fp8_kernels():
        return trace_rank_post_load(model, classes, keep_model=keep_model)


def test_restored_model_post_loads_again_and_keeps_every_object(configs):
    model = _model(configs("fp8-glm"))
    before = _state(model)
    first = _post_load(model, keep_model=True)
    assert _state(model) == before
    again = _post_load(model, keep_model=True)
    assert again == first and _state(model) == before
    assert first == _post_load(_model(configs("fp8-glm")))  # a fresh model, processed for good


def test_post_load_layer_reuse_equals_processing_every_layer(configs):
    from weightplan.compiler.frontend.layer_classes import LayerClasses

    classes = LayerClasses(template_of={2: 1, 3: 1, 4: 1}, guards={5: 1})  # layers 1-5: the MoE layers
    reused = _post_load(_model(configs("fp8-glm-6")), classes)
    assert reused == _post_load(_model(configs("fp8-glm-6")))
    assert any(".layers.3." in t.staging for t in reused.tensors) and any(".layers.3." in d.module for d in reused.derived)


def test_post_load_layer_guard_processes_a_class_that_differs(configs):
    """A wrong class (dense layer 0 as the template of MoE layers) fails its guard and is processed for real."""
    from weightplan.compiler.frontend.layer_classes import LayerClasses

    wrong = LayerClasses(template_of={1: 0, 2: 0, 3: 0, 4: 0}, guards={5: 0})
    assert _post_load(_model(configs("fp8-glm-6")), wrong) == _post_load(_model(configs("fp8-glm-6")))
