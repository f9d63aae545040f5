"""vLLM pipeline ranks as plan destinations: vLLM's own stage split, and each pipeline rank proven against vLLM's load."""

from __future__ import annotations

import os
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
from weightplan.compiler.frontend.pipeline_stages import check_pipeline_stages, stage_layers
from weightplan.compiler.layouts import InferenceLayout, parse_inference
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

from ..conftest import config_dir
from ..support.verified_plans import verified_plan

_LAYER = re.compile(r"\.layers\.(\d+)\.")


@settings(max_examples=200, deadline=None)
@given(tp=st.integers(1, 8), pp=st.integers(1, 8), dp=st.integers(1, 8), data=st.data())
def test_rank_numbering_is_vllms(tp, pp, dp, data):
    # vLLM's initialize_model_parallel lays global ranks out as arange(world).reshape(dp, pp, pcp=1, tp)
    grid = torch.arange(tp * pp * dp).reshape(dp, pp, tp)
    layout = InferenceLayout(tp=tp, dp=dp, pp=pp)
    rank = data.draw(st.integers(0, layout.ranks - 1))
    at = layout.rank_coords(rank)
    assert grid[at.dp, at.pp, at.tp] == rank
    assert layout.rank_of(at) == rank


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 120), pp=st.integers(1, 16))
def test_stages_split_every_layer_once(layers, pp):
    if pp > layers:
        with pytest.raises(ModelConfigError, match=f"pp={pp} is more than the model's {layers} hidden layers"):
            check_pipeline_stages({"num_hidden_layers": layers}, pp)
        return
    stages = check_pipeline_stages({"num_hidden_layers": layers}, pp)
    assert [layer for held in stages for layer in held] == list(range(layers))  # contiguous, in order, each once
    assert all(len(held) >= 1 for held in stages)
    sizes = [len(held) for held in stages]
    assert max(sizes) - min(sizes) <= 1  # vLLM's even split; any extra layer goes to a stage before the last
    assert sizes[-1] == min(sizes)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_layer_partition_env_is_honoured(sizes):
    layers = sum(sizes)
    with mock.patch.dict(os.environ, {"VLLM_PP_LAYER_PARTITION": ",".join(map(str, sizes))}):
        if layers == 0:
            with pytest.raises(ModelConfigError, match="VLLM_PP_LAYER_PARTITION"):
                check_pipeline_stages({"num_hidden_layers": len(sizes)}, len(sizes))  # partitions sum to 0
        elif 0 in sizes:
            expected = "is more than the model" if len(sizes) > layers else f"pipeline rank {sizes.index(0)} holds no layers"
            with pytest.raises(ModelConfigError, match=expected):
                check_pipeline_stages({"num_hidden_layers": layers}, len(sizes))
        else:
            assert [len(held) for held in check_pipeline_stages({"num_hidden_layers": layers}, len(sizes))] == sizes


@pytest.mark.parametrize("text,message", [
    ("pp=0", "bad --inference item 'pp=0'"),
    ("tp=2,pp=2,pp=3", "gives pp twice"),
])
def test_bad_pp_items(text, message):
    with pytest.raises(ModelConfigError, match=message):
        parse_inference(text)


def test_bad_partition_env_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,1")
    with pytest.raises(ModelConfigError, match=r"VLLM_PP_LAYER_PARTITION: sum\(partitions\)=2 does not match num_hidden_layers=3"):
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=tmp_path / "p.plan", inference="tp=1,pp=2"))
    assert not (tmp_path / "p.plan").exists()


PIPELINE_CASES = [
    ("tiny-llama", "hf", "bf16", "fsdp=3", "tp=2,pp=2"),
    ("tiny-llama", "hf", "bf16", "fsdp=2", "tp=1,pp=3"),  # one layer per stage: embedding, middle, head
    ("tiny-qwen3-moe", "stacked", "bf16", "fsdp=4,ep=2", "pp=2,dp=2,ep"),  # EP within each stage, DP models shared
    ("tiny-deepseek-v3", "stacked", "bf16", "fsdp=2", "tp=2,pp=3"),  # MLA, dense first layer, uneven split [2, 1, 1]
]


@pytest.mark.parametrize("model,fmt,dtype,trainer,inference", PIPELINE_CASES)
def test_pipeline_ranks_match_vllm(plan_cache, model, fmt, dtype, trainer, inference):
    plan = verified_plan(plan_cache, model, fmt, dtype, trainer, inference, seed=3)
    info = plan.header.inference
    # every layer's parameters lie on the pipeline ranks vLLM gives that layer
    import json

    stages = stage_layers(json.loads((config_dir(model) / "config.json").read_text())["num_hidden_layers"], info.pp)
    seen_layers = set()
    for entry in plan.dests:
        layer = _LAYER.search(entry.name)
        if layer:
            assert all(int(layer[1]) in stages[info.rank_coords(rank).pp] for rank in entry.ranks), entry.name
            seen_layers.add(int(layer[1]))
    # and each rank receives exactly the parameters vLLM's model of that rank holds (embedding and head included:
    # Llama's are PPMissingLayer off the first / last stage, Qwen3-MoE builds them on every stage)
    config = make_vllm_config(config_dir(model), tp=info.tp, dp=info.dp, ep=info.ep, pp=info.pp)
    base = make_vllm_config(config_dir(model))
    for rank in range(plan.header.dst_ranks):
        at = info.rank_coords(rank)
        built = build_model(config, tp_rank=at.tp, dp_rank=at.dp, pp_rank=at.pp, base_config=base)
        planned = {e.name for e in plan.dests if rank in e.ranks} | {e.name for e in plan.unloaded if rank in e.ranks}
        assert planned == {name for name, _ in built.named_parameters()}, rank
    assert seen_layers == {layer for held in stages for layer in held}


def test_partition_env_moves_layers(plan_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    out = tmp_path / "p.plan"
    compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer="fsdp=2", inference="pp=2"))
    plan = load_plan(out)
    held = {int(_LAYER.search(e.name)[1]): e.ranks for e in plan.dests if _LAYER.search(e.name)}
    assert held == {0: (0,), 1: (1,), 2: (1,)}
    assert verify_plan(out, model=str(config_dir("tiny-llama")), seed=1).mismatches == ()
