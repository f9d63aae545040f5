"""A pipelined trainer to vLLM pipeline ranks over real NIXL/UCX between processes: each inference stage's receiver,
into the model vLLM's loader builds for that stage, ends with vLLM's own load of the trainer's weights."""

from __future__ import annotations

import pytest
import torch

from weightplan.runtime import load_plan

from ..conftest import config_dir
from ..support.fake_world import as_rank, run_in_fresh_process
from ..support.pipeline_stage import stage_module
from ..support.runtime_harness import Job

VERSIONS = (1, 2)
_LAYER_OF_STAGE = [lambda n: not n.startswith(("lm_head", "model.norm", "model.layers.2.")),
                   lambda n: not n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))]


def test_two_stage_trainer_to_two_pipeline_ranks(plan_cache, tmp_path):
    path = plan_cache("tiny-llama", "hf", "fp32", "pp=2,fsdp=2", "tp=1,pp=2")
    plan = load_plan(path)
    assert plan.header.trainer.pp == 2 and plan.header.inference.pp == 2
    with Job(tmp_path, path, "pp-sync") as job:
        job.start_sync(str(config_dir("tiny-llama")), 2, 4, VERSIONS)
        for version in VERSIONS:
            _, released = job.synced(2, 4, version)
            # trainer stage s (ranks 2s, 2s + 1) serves exactly inference pipeline rank s
            assert [e["acked"] for e in released] == [[0], [0], [1], [1]], released
        job.assert_clean_exit()


def test_live_sender_serves_a_stage_module_and_refuses_another_stages_plan_rank(plan_cache):
    path = plan_cache("tiny-llama", "hf", "fp32", "pp=2,fsdp=2", "tp=1,pp=2")
    run_in_fresh_process(_stage_modules, str(path), str(config_dir("tiny-llama")))


def _stage_modules(path: str, model_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from weightplan.runtime import PlanMismatchError
    from weightplan.runtime.sender.live_module import LiveSender

    plan = load_plan(path)
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), torch_dtype=torch.float32)
    stages = [range(0, 2), range(2, 3)]  # torchtitan's split of 3 layers into 2 stages
    modules = []
    for rank in range(4):
        as_rank(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "fsdp"))
        stage = rank // 2
        module = stage_module(full, stage, stages[stage], stage == 1) if rank % 2 == 0 else modules[-1]
        if rank % 2 == 0:
            fully_shard(module, mesh=mesh["fsdp"])
            modules.append(module)
        sender = LiveSender(plan, rank, module)  # its layout checked against the plan's stage: accepted
        held = {e.name for i, e in enumerate(plan.sources) if plan.shard_layout.box(i, rank) is not None}
        assert set(sender._locals) == held and all(_LAYER_OF_STAGE[stage](n) for n in held)
        other = 2 * (1 - stage)
        with pytest.raises(PlanMismatchError, match=rf"trainer rank {other} is pipeline stage {1 - stage} of 2 in the plan, "
                                                    rf"but the module holds stage {stage}'s tensors") as caught:
            LiveSender(plan, other, module)
        assert "\n" not in str(caught.value)
