"""Pipeline-parallel trainers as plan sources: torchtitan's stage split, per-stage sources, proven against vLLM's load."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.errors import ModelConfigError
from weightplan.compiler.frontend.trainer_formats import TrainerFormat, trainer_specs
from weightplan.compiler.layouts import check_trainer_stages, parse_trainer
from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.trainer_stages import parse_staged, torchtitan_stage_sizes
from weightplan.runtime import load_plan

from ..conftest import config_dir
from ..support.verified_plans import verified_plan

_LAYER = re.compile(r"layers\.(\d+)\.")


@settings(max_examples=100, deadline=None)
@given(layers=st.integers(1, 100), pp=st.integers(1, 16))
def test_stage_split_is_torchtitans(layers, pp):
    pipeline = pytest.importorskip("torchtitan.experiments.transformers_modeling_backend.pipeline")
    try:
        parts = pipeline.generate_llm_fqn_per_model_part(pp, layers)
    except ValueError:
        with pytest.raises(ModelConfigError):
            torchtitan_stage_sizes(layers, pp)
        return
    sizes = torchtitan_stage_sizes(layers, pp)
    assert sizes == [sum(m.startswith("layers.") for m in part) for part in parts]
    assert "tok_embeddings" in parts[0] and "lm_head" in parts[-1]
    # what torchtitan builds, a first or last stage without a decoder layer included, compiles
    staged = parse_staged({"pp": str(pp)}, "").resolve({"num_hidden_layers": layers})
    assert [len(r) for r in staged.layers] == sizes


STAGED_CASES = [
    ("tiny-llama", "hf", "bf16", "pp=2,fsdp=2", "tp=2,pp=2"),
    ("tiny-llama", "hf", "bf16", "pp=3,pp-layers=1+1+1", "tp=1"),
    ("tiny-llama", "hf", "bf16", "pp=3", "tp=1"),  # torchtitan's split [1, 2, 0]: the last stage holds norm and head only
    ("tiny-llama", "hf", "bf16", "pp=5", "tp=2"),  # [0, 1, 1, 1, 0]: the first holds the embedding only
    ("tiny-qwen3-moe", "stacked", "bf16", "pp=2,fsdp=2,ep=2", "dp=2,ep"),
    ("vocab-llama-tied", "hf", "bf16", "pp=2,fsdp=2", "tp=1,pp=2"),  # tied embedding: on both trainer stages
]


@pytest.mark.parametrize("model,fmt,dtype,trainer,inference", STAGED_CASES)
def test_staged_trainer_plan_matches_vllm(plan_cache, model, fmt, dtype, trainer, inference):
    plan = verified_plan(plan_cache, model, fmt, dtype, trainer, inference, seed=4)
    stages = plan.header.trainer.pp
    assert plan.header.trainer.token.startswith(f"pp{stages}-") and trainer.startswith(f"pp={stages}")
    per_stage = plan.header.src_ranks // stages
    # every trainer rank reads only tensors its stage holds: a layer's bytes come from one stage
    runs = plan.runs
    read_from: dict[str, set[int]] = {}
    for i in range(plan.n_runs):
        name = plan.sources[runs["src"][i]].name
        read_from.setdefault(name, set()).add(int(runs["src_rank"][i]) // per_stage)
    for name, held in read_from.items():
        if _LAYER.search(name):
            assert len(held) == 1, (name, held)
    boxes = {s.name: [plan.local_shape(i, r) for r in range(plan.header.src_ranks)] for i, s in enumerate(plan.sources)}
    embed = next(n for n in boxes if "embed_tokens" in n)
    held_by = {r // per_stage for r, shape in enumerate(boxes[embed]) if np.prod(shape) > 0}
    tied = not any(n.startswith("lm_head") for n in boxes)
    assert held_by == ({0, stages - 1} if tied else {0})


@pytest.mark.parametrize("trainer,message", [
    ("pp=6", "trainer pp=6 is more than the model's 3 hidden layers plus embedding and head"),
    ("pp=3,pp-layers=1+0+2", "stage 1 holds no layers"),
    ("pp=3,pp-layers=1+1", "pp-layers gives 2 stages, pp=3"),
    ("pp=2,pp-layers=1+1", "covers 2 layers; the model has 3"),  # a stage list that skips a layer
    ("pp=2,pp-layers=2+2", "covers 4 layers; the model has 3"),  # ... or repeats one
    ("pp=2,pp=3", "gives pp or pp-layers twice"),
    ("pp-layers=1+2", "pp-layers needs pp=P"),
    ("pp=x", "bad --trainer item 'pp=x'"),
    ("pp=2,pp-layers=1,2", "bad --trainer item '2'"),
])
def test_bad_trainer_stages_are_one_line(tmp_path, trainer, message):
    out = tmp_path / "never.plan"
    with pytest.raises(ModelConfigError, match=message) as caught:
        compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer=trainer))
    assert "\n" not in str(caught.value)
    assert not out.exists()


def test_stage_pairs_carry_each_layer_once(plan_cache):
    # torchtitan's split of 3 layers into 2 stages ([2, 1]) is vLLM's: every byte stays within its stage pair
    summary = summarize(load_plan(plan_cache("tiny-llama", "hf", "bf16", "pp=2,fsdp=2", "tp=2,pp=2")))
    pairs = summary["bytes_per_stage_pair"]
    assert pairs[0][1] == pairs[1][0] == 0 < min(pairs[0][0], pairs[1][1])
    assert pairs[0][0] + pairs[1][1] == summary["wire_bytes"]
    assert summarize(load_plan(plan_cache("tiny-llama", "hf", "bf16", "fsdp=3", "tp=2")))["bytes_per_stage_pair"] is None


def _as_layout_file(staged, specs, path, pp=None) -> None:
    """Write the shards of a `--trainer pp=` layout as a --trainer-layout file (meshes and placements, and `pp`)."""
    names = frozenset(s.name for s in specs)
    meshes, tensors = [], {}
    for spec in specs:
        sharding = staged.sharding_of(spec, names)
        mesh = {"shape": list(sharding.mesh.shape), "ranks": np.array(sharding.mesh.ranks).reshape(sharding.mesh.shape).tolist()}
        if mesh not in meshes:
            meshes.append(mesh)
        tensors[spec.name] = {"shape": list(spec.shape), "dtype": spec.dtype, "mesh": meshes.index(mesh),
                              "placements": [str(p) for p in sharding.placements]}
    path.write_text(json.dumps({"format": "weightplan-trainer-layout", "version": 1, "world_size": staged.ranks,
                                "pp": staged.pp if pp is None else pp, "meshes": meshes, "tensors": tensors}))


@pytest.mark.parametrize("model,fmt,trainer,token", [
    ("tiny-llama", "hf", "pp=2,fsdp=2", "pp2-fsdp2"),
    ("tiny-llama", "hf", "pp=2,pp-layers=1+2,fsdp=2", "pp2-layers1+2-fsdp2"),  # not torchtitan's split: the explicit one
    ("tiny-llama", "hf", "pp=3,pp-layers=1+1+1", "pp3-layers1+1+1-fsdp1"),  # torchtitan's split would leave stage 2 empty
    ("vocab-llama-tied", "hf", "pp=2,fsdp=2", "pp2-fsdp2"),  # the tied embedding: one entry replicated over both stages
    # FSDP over EP within each stage (_StridedShard experts): the same boxes as plain FSDP here, so the file takes the
    # smallest-ep name, as unpipelined files do; the shorthand keeps the token it was given
    ("tiny-qwen3-moe", "stacked", "pp=2,fsdp=2,ep=2", "pp2-fsdp2"),
])
def test_a_pipelined_layout_file_binds_as_its_shorthand(tmp_path, model, fmt, trainer, token):
    config = json.loads((config_dir(model) / "config.json").read_text())
    specs = trainer_specs(config_dir(model), TrainerFormat(fmt), torch.bfloat16)
    staged = check_trainer_stages(parse_trainer(trainer, fmt=TrainerFormat(fmt)), config)
    _as_layout_file(staged, specs, tmp_path / "layout.json")
    from_file = check_trainer_stages(parse_trainer("fsdp=1", tmp_path / "layout.json", TrainerFormat(fmt)), config)
    assert from_file.pp == staged.pp
    bound, shorthand = from_file.bind(specs), staged.bind(specs)
    assert (bound.token, bound.classes, bound.of) == (token, shorthand.classes, shorthand.of)


def test_a_pipelined_layout_file_no_shorthand_describes_keeps_its_own_token(tmp_path):
    config = json.loads((config_dir("tiny-llama") / "config.json").read_text())
    specs = trainer_specs(config_dir("tiny-llama"), TrainerFormat.HF, torch.bfloat16)
    _as_layout_file(check_trainer_stages(parse_trainer("pp=2,fsdp=2"), config), specs, tmp_path / "layout.json")
    data = json.loads((tmp_path / "layout.json").read_text())
    norm = data["tensors"]["model.norm.weight"]
    norm["placements"] = ["Replicate()"] * len(norm["placements"])  # on the last stage, whole on both its ranks
    (tmp_path / "layout.json").write_text(json.dumps(data))
    from_file = check_trainer_stages(parse_trainer("fsdp=1", tmp_path / "layout.json"), config)
    assert from_file.pp == 2 and from_file.bind(specs).token.startswith("layout-")
