"""LiveSender on a pipelined trainer's stage modules under a fake process group: each stage's module is accepted for its
own ranks and refused, in one line, as a rank of another stage. The multi-process NIXL sync of the same plan (into the
models vLLM's loader builds for each pipeline rank, equal to vLLM's own load) is tests/runtime/test_pipeline_layout.py,
whose live FSDP2 stage modules serve a plan with this one's fingerprint."""

from __future__ import annotations

import pytest
import torch

from weightplan.runtime import load_plan

from ..conftest import config_dir
from ..support.fake_world import as_rank, run_in_fresh_process
from ..support.pipeline_stage import stage_module

_LAYER_OF_STAGE = [lambda n: not n.startswith(("lm_head", "model.norm", "model.layers.2.")),
                   lambda n: not n.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))]


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
