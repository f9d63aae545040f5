"""Serving a live FSDP2 trainer (runtime/sender/live_module.py): real FSDP2 over gloo in 2 and 4 processes trains, publishes
and syncs into a vLLM model whose digests must equal vLLM's own load of the trainer's gathered full state dict;
plans for another layout are refused before anything is registered; reallocated storages are re-registered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.runtime import Rendezvous

from ..conftest import config_dir
from ..support.fake_world import as_rank, run_in_fresh_process

ROOT = Path(__file__).resolve().parents[2]
RL_LOOP = ROOT / "examples" / "rl_loop.py"


def _rl_loop(tmp_path, *args: str) -> list[dict]:
    """Run examples/rl_loop.py --check; its JSON lines (one per step, plus start and done)."""
    out = subprocess.run([sys.executable, str(RL_LOOP), "--check", "--workdir", str(tmp_path), "--timeout", "120",
                          "--job", f"live-{tmp_path.name[-20:]}", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _check_steps(lines: list[dict], steps: int) -> list[dict]:
    rows = [line for line in lines if "step" in line]
    assert [r["step"] for r in rows] == list(range(steps + 1))
    for row in rows:
        assert row["digests"] > 0 and row["n_differ"] == 0, row
        assert row["missing_in_full"] == [], row  # the gathered state dict has every plan tensor
        assert row["fresh_tokens_equal"], row  # generation on the synced bytes == a fresh load of the trainer's weights
    assert rows[0]["tokens"] != rows[-1]["tokens"], "training visibly changes the greedy output"
    return rows


def test_two_fsdp2_ranks_fp32_masters_bf16_wire_with_wrappers(tmp_path):
    """fp32 masters under MixedPrecisionPolicy(param_dtype=bf16), reshard_after_forward=True, activation
    checkpoint and torch.compile wrappers (`_checkpoint_wrapped_module.`, `_orig_mod.` in the module's names)."""
    lines = _rl_loop(tmp_path, "--inference", "receiver", "--trainers", "2", "--ep", "1", "--masters", "fp32",
                     "--steps", "1", "--checkpoint", "--compile-wrapper")  # one round: two optimizer steps
    assert lines[0]["plan"].startswith("layout-")  # no shorthand: FSDP2 keeps buffers whole on every rank
    _check_steps(lines, 1)
    layout = json.loads((tmp_path / "trainer-layout.json").read_text())
    assert not any("_orig_mod" in n or "_checkpoint_wrapped_module" in n for n in layout["tensors"])
    assert layout["tensors"]["model.embed_tokens.weight"]["dtype"] == "float32"
    assert layout["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]["placements"] == ["Shard(0)"]
    assert layout["world_size"] == 2


def test_four_ranks_ep_2d_mesh_bf16_masters_checkpoint_reload(tmp_path):
    """A (dp_shard=2, ep=2) mesh with experts Shard(0) over ep, bf16 masters, reshard_after_forward=False, and a
    load_state_dict(assign=True) before version 2: its new storages are registered, never stale bytes."""
    lines = _rl_loop(tmp_path, "--inference", "receiver", "--trainers", "4", "--ep", "2", "--masters", "bf16",
                     "--steps", "1", "--keep-unsharded", "--reload-at", "2")
    rows = _check_steps(lines, 1)
    assert [r["reregistered"] for r in rows] == [0, 1]
    layout = json.loads((tmp_path / "trainer-layout.json").read_text())
    experts = layout["tensors"]["model.layers.1.mlp.experts.gate_up_proj"]
    assert experts["placements"] == ["_StridedShard(0, split_factor=2)", "Shard(0)"]
    assert layout["meshes"][experts["mesh"]] == {"shape": [2, 2], "ranks": [[0, 1], [2, 3]]}


def test_rl_loop_through_a_vllm_engine_generates_what_a_fresh_engine_on_the_checkpoint_generates(tmp_path):
    """The default demo: a vllm.LLM CPU engine with the weightplan backend starts on dummy weights, takes every version
    from 2 FSDP2 trainers (fp32 masters, bf16 wire) through vLLM's weight-transfer API, with each update's bytes
    checked against the trainers' digests; after the last step its greedy tokens and logprobs equal those of a
    fresh engine loaded from a safetensors checkpoint of the trainers' gathered state dict."""
    lines = _rl_loop(tmp_path, "--trainers", "2", "--ep", "1", "--masters", "fp32", "--steps", "2")
    assert lines[0]["inference"] == "engine"
    rows = [line for line in lines if "step" in line]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["bytes"] > 0 and r["update_s"] > 0 for r in rows), rows
    assert rows[0]["tokens"] != rows[-1]["tokens"], "training, then the updates, visibly change what the engine generates"
    assert rows[-1]["fresh_engine_tokens_equal"] and rows[-1]["fresh_engine_logprobs_equal"], rows[-1]
    assert (tmp_path / "checkpoint-last" / "config.json").exists()


def _fsdp_rank0(dtype=torch.float32, **kw):
    """Rank 0 of a fake 4-rank world: the tiny DeepSeek-V3 trainer under fully_shard (no collectives needed)."""
    from weightplan.testing import moe_trainer as mt

    as_rank(0, 4)
    return mt.parallelize(mt.build_model(mt.CONFIG, dtype), **kw)


def _write_layout(path):
    from weightplan.runtime import write_trainer_layout

    write_trainer_layout(_fsdp_rank0(), path)


def _refusals_and_reregistration(layout_plan, address):
    from weightplan.runtime import LiveSender, PlanMismatchError, load_plan, trainer_tensors
    from weightplan.runtime.sender import sender as sender_module

    rendezvous = Rendezvous.connect("live-unit", address)
    # After a forward with reshard_after_forward=False the module holds the all-gathered copies; the sharded
    # masters are what is served. (The fake world's all-gather moves no bytes; only shapes matter here.)
    model = _fsdp_rank0(reshard_after_forward=False)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    held = dict(model.named_parameters())["model.embed_tokens.weight"]
    served = trainer_tensors(model)["model.embed_tokens.weight"]
    assert not hasattr(held, "to_local") and tuple(held.shape) == (320, 64)
    assert tuple(served.to_local().shape) == (80, 64)

    agent = sender_module.NixlAgent

    def refuse(*args, **kwargs):
        raise AssertionError("a NIXL agent was created before the layout was checked")

    sender_module.NixlAgent = refuse
    # The plan is for FSDP2 over 4 ranks; this module keeps its experts on a (dp_shard=2, ep=2) mesh.
    with pytest.raises(PlanMismatchError, match=r"trainer tensor 'model\.layers\.1\.mlp\.experts\.gate_up_proj': the module "
                                                r"places it \(_StridedShard\(0, split_factor=2\), Shard\(0\)\) on mesh \[2, 2\] "
                                                r"of ranks \[0, 1, 2, 3\], so trainer rank 1 holds \[4:6, 0:48, 0:64\]; the plan "
                                                r"\(trainer layout layout-[0-9a-f]{12}\) has rank 1 holding \[2:4, 0:48, 0:64\]"):
        LiveSender(load_plan(layout_plan), 0, _fsdp_rank0(ep=2), rendezvous=rendezvous)
    with pytest.raises(PlanMismatchError, match=r"'model\.embed_tokens\.weight' is bfloat16 in the module, the plan "
                                                r"expects float32.*--trainer-dtype bf16"):
        LiveSender(load_plan(layout_plan), 0, _fsdp_rank0(torch.bfloat16), rendezvous=rendezvous)
    sender_module.NixlAgent = agent

    sender = LiveSender(load_plan(layout_plan), 0, model, rendezvous=rendezvous, timeout=5).start()
    sender.publish(1)
    assert sender.changed() == [] and sender.reregistered == 0
    # An optimizer step updates the shards in place: nothing to re-register.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1)
    sender.publish(2)
    assert sender.reregistered == 0
    # A checkpoint load with assign=True reallocates every shard: registered again, same layout.
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    assert "model.embed_tokens.weight" in sender.changed()
    first = sender.incarnation
    sender.publish(3)
    assert sender.reregistered == 1 and sender.incarnation != first
    # A load that changes a dtype changes the layout: refused, nothing published.
    gate = model.model.layers[1].mlp.gate
    gate.e_score_correction_bias = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(PlanMismatchError, match=r"e_score_correction_bias' is bfloat16 in the module, the plan expects float32"):
        sender.publish(4)
    assert not rendezvous.exists("trainer/0/version/4")
    sender.close()
    _tied_unsharded()  # here to share this process's start-up


def test_plans_for_other_layouts_are_refused_and_reallocated_storage_is_registered_again(tmp_path):
    """Also: served tensors are the sharded masters after a forward with reshard_after_forward=False, tied weights once."""
    layout = tmp_path / "layout.json"
    run_in_fresh_process(_write_layout, layout)
    layout_plan = tmp_path / "live.plan"
    compile_plan(CompileOptions(str(config_dir("tiny-deepseek-v3")), "stacked", "fp32", output=layout_plan,
                                trainer_layout=layout))
    store = Rendezvous.connect("live-unit", "127.0.0.1:0", serve=True)
    run_in_fresh_process(_refusals_and_reregistration, layout_plan, store.address)


def test_wrapper_components_are_removed_from_trainer_names():
    from weightplan.runtime.layout.module_tensors import trainer_name

    assert trainer_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.down_proj.weight") == \
        "model.layers.0.mlp.down_proj.weight"
    assert trainer_name("_fsdp_wrapped_module.lm_head.weight") == "lm_head.weight"


def _tied_unsharded():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from weightplan.runtime import trainer_tensors

    as_rank(0, 4)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model, mesh=init_device_mesh("cpu", (4,)), reshard_after_forward=False)
    with torch.no_grad():
        model(torch.tensor([[1, 2]]))  # both modules now hold the all-gathered copy
    tensors = trainer_tensors(model)
    assert list(tensors) == ["0.weight"] and tuple(tensors["0.weight"].to_local().shape) == (2, 4)
