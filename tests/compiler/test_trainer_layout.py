"""--trainer-layout: files written from live DTensors give the shorthand's exact plan; explicit layouts the
shorthand cannot express match vLLM's own load; bad files are refused naming the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.trainer_formats import TrainerFormat, trainer_specs
from weightplan.compiler.plan_summary import summarize
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import LayoutError, load_plan, write_trainer_layout

from ..conftest import config_dir
from ..support.fake_world import as_rank, run_in_fresh_process


def _torchtitan_fsdp4_ep2(specs) -> dict[str, torch.Tensor]:
    """DTensors laid out as torchtitan's FSDP=4 x EP=2 would: dense Shard(0) over 4 ranks; expert
    stacks EP-sharded on mesh dim "ep", then FSDP-sharded by FSDP2 as _StridedShard(0, split_factor=2)."""
    fsdp = DeviceMesh("cpu", torch.arange(4))
    experts = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    out = {}
    for spec in specs:
        full = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
        if spec.sharding == "expert":
            out[spec.name] = distribute_tensor(full, experts, [_StridedShard(0, split_factor=2), Shard(0)], src_data_rank=None)
        else:
            out[spec.name] = distribute_tensor(full, fsdp, [Shard(0)], src_data_rank=None)
    return out


def _write_tiny_glm_fsdp4_ep2(path):
    as_rank(0, 4)
    write_trainer_layout(_torchtitan_fsdp4_ep2(trainer_specs(config_dir("tiny-glm"), TrainerFormat.STACKED, torch.bfloat16)), path)


def test_layout_written_from_dtensors_gives_the_shorthand_plan_byte_for_byte(plan_cache, tmp_path):
    model = config_dir("tiny-glm")
    layout = tmp_path / "layout.json"
    run_in_fresh_process(_write_tiny_glm_fsdp4_ep2, layout)
    data = json.loads(layout.read_text())
    assert data["world_size"] == 4 and len(data["meshes"]) == 2
    assert data["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]["placements"] == ["_StridedShard(0, split_factor=2)", "Shard(0)"]

    explicit = tmp_path / "explicit.plan"
    compile_plan(CompileOptions(str(model), "stacked", "bf16", output=explicit, trainer_layout=layout, inference="dp=4,ep"))
    shorthand = plan_cache("tiny-glm", "stacked", "bf16", "fsdp=4,ep=2", "dp=4,ep")
    assert explicit.read_bytes() == shorthand.read_bytes()
    assert load_plan(explicit).header.trainer.token == "fsdp4-ep2"


def test_module_layout_writes_buffers_replicated_and_tied_weights_once(tmp_path):
    run_in_fresh_process(_module_layout, tmp_path / "m.json")


def _module_layout(path):
    as_rank(0, 4)
    mesh = DeviceMesh("cpu", torch.arange(4))
    module = torch.nn.Module()
    module.embed = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)], src_data_rank=None))
    module.head = module.embed
    module.register_buffer("bias", torch.zeros(3))
    data = json.loads(write_trainer_layout(module, path).read_text())
    assert list(data["tensors"]) == ["embed", "bias"]
    assert data["tensors"]["bias"] == {"shape": [3], "dtype": "float32", "mesh": 0, "placements": ["Replicate()"]}
    assert data["meshes"] == [{"shape": [4], "ranks": [0, 1, 2, 3]}]  # the world mesh, stored once


def test_partial_placements_are_refused(tmp_path):
    run_in_fresh_process(_partial_refused, tmp_path / "p.json")


def _partial_refused(path):
    from torch.distributed.tensor import DTensor, Partial

    as_rank(0, 4)
    mesh = DeviceMesh("cpu", torch.arange(4))
    partial = DTensor.from_local(torch.zeros(2), mesh, [Partial()], run_check=False)
    with pytest.raises(LayoutError, match="tensor 'w' has placement Partial"):
        write_trainer_layout({"w": partial}, path)


def _explicit_llama_layout(path):
    """A 2-D mesh with Shard(0)+Shard(1), Shard(1)+Replicate(), FSDP-over-TP style _StridedShard, and
    replicated tensors on a 1-D mesh with permuted ranks: none of it is fsdp/ep/replicas."""
    specs = trainer_specs(config_dir("tiny-llama"), TrainerFormat.HF, torch.bfloat16)
    styles = [["Shard(0)", "Shard(1)"], ["Shard(1)", "Replicate()"], ["_StridedShard(0, split_factor=2)", "Shard(0)"]]
    tensors = {}
    for i, spec in enumerate(specs):
        if len(spec.shape) == 2 and spec.shape[0] % 4 == 0:
            entry = {"mesh": 0, "placements": styles[i % 3]}
        else:
            entry = {"mesh": 1, "placements": ["Replicate()"]}
        tensors[spec.name] = {"shape": list(spec.shape), "dtype": spec.dtype, **entry}
    path.write_text(json.dumps({
        "format": "weightplan-trainer-layout", "version": 1, "world_size": 4,
        "meshes": [{"shape": [2, 2], "ranks": [[0, 1], [2, 3]]}, {"shape": [4], "ranks": [3, 1, 0, 2]}],
        "tensors": tensors,
    }))
    return path


def test_explicit_layout_matches_vllm_on_every_rank(tmp_path):
    layout = _explicit_llama_layout(tmp_path / "layout.json")
    out = tmp_path / "explicit.plan"
    compile_plan(CompileOptions(str(config_dir("tiny-llama")), output=out, trainer_layout=layout, inference="tp=2"))
    plan = load_plan(out)
    assert plan.header.trainer.token.startswith("layout-")
    result = verify_plan(out, model=str(config_dir("tiny-llama")), seed=3)
    assert result.mismatches == ()
    assert result.tensors == sum(len(e.ranks) for e in plan.dests)
    summary = summarize(plan)
    assert summary["dst_coverage"] == 1.0
    assert min(summary["bytes_per_src_rank"]) > 0
    # Replicated tensors are split among their holders (passes/source_flow.py) so that, with the sharded
    # bytes, every trainer rank serves the same bytes here; more than one holder serves them.
    replicated = [i for i, e in enumerate(plan.sources) if all(plan.shard_box(i, r) == plan.shard_box(i, 0) for r in range(4))]
    served = {int(r) for i in replicated for r in plan.runs["src_rank"][plan.runs["src"] == i]}
    assert len(served) > 1 and len(set(summary["bytes_per_src_rank"])) == 1
