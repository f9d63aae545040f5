"""A live pipeline-parallel FSDP2 trainer (4 gloo processes, 2 stages of 2 ranks, each building and sharding only its own
layers) writes one layout file with `write_pipeline_layout`; it compiles to the same plan as `--trainer pp=2,fsdp=2`, and
LiveSenders on the stage modules sync two pipeline ranks of vLLM models to vLLM's own load of the trainer's weights."""

from __future__ import annotations

import json

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.runtime import load_plan, read_trainer_layout

from ..conftest import config_dir
from weightplan.testing.runtime_harness import Job

VERSIONS = (1, 2)


def test_live_pipelined_trainer_layout_compiles_to_the_shorthands_plan_and_syncs(plan_cache, tmp_path):
    model = str(config_dir("tiny-llama"))
    path = tmp_path / "layout.plan"
    with Job(tmp_path, path, "pp-layout") as job:
        for rank in range(4):
            job.start_module(f"tr{rank}", "tests.support.pipeline_trainer_worker", "--rank", str(rank), "--world", "4",
                             "--pp", "2", "--layers", "2+1", "--workdir", str(tmp_path), "--model", model,
                             "--versions", ",".join(map(str, VERSIONS)))
        held = [job.event(f"tr{rank}", "layout")["tensors"] for rank in range(4)]
        assert held[0] == held[1] and held[2] == held[3] and not set(held[0]) & set(held[2])  # each stage: only its tensors
        layout = read_trainer_layout(tmp_path / "trainer-layout.json")
        assert layout.pp == 2 and layout.world_size == 4

        compile_plan(CompileOptions(model, "hf", "fp32", "none", path, trainer_layout=tmp_path / "trainer-layout.json",
                                    inference="tp=1,pp=2"))
        plan, shorthand = load_plan(path), load_plan(plan_cache("tiny-llama", "hf", "fp32", "pp=2,fsdp=2", "tp=1,pp=2"))
        assert (plan.header.trainer.pp, plan.header.trainer.token) == (2, "pp2-fsdp2")
        assert plan.header.fingerprint == shorthand.header.fingerprint

        for k in range(2):
            job.start(f"inf{k}", "inference", k, "--versions", ",".join(map(str, VERSIONS)), "--model", model, "--verify",
                      "--timeout", "60")
        (tmp_path / "go.json").write_text(json.dumps({"plan": str(path), "job": job.name, "address": job.address}))
        for rank in range(4):
            stage, other = rank // 2, 1 - rank // 2
            assert job.event(f"tr{rank}", "refused")["error"] == (
                f"trainer rank {2 * other} is pipeline stage {other} of 2 in the plan, but the module holds stage {stage}'s "
                f"tensors; run it as a trainer rank of stage {stage} (ranks {2 * stage}..{2 * stage + 1})")
        for version in VERSIONS:
            _, released = job.synced(2, 4, version)  # digests equal vLLM's load on both pipeline ranks
            assert [e["acked"] for e in released] == [[0], [0], [1], [1]], released
        job.assert_clean_exit()
