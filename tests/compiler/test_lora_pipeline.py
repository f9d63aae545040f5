"""LoRA plans with pipeline parallelism: each inference stage's LoRA layers only, trainer adapters on their layers' stage."""

from __future__ import annotations

import numpy as np

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.layouts import check_trainer_stages, parse_trainer
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan

from ..conftest import config_dir

PEFT_EMBED = "base_model.model.model.embed_tokens.lora_embedding_A"


def test_pipeline_lora_plan_traces_each_stage_and_matches_vllm(tmp_path):
    """Tied Llama (vLLM builds embed_tokens on the first and, tied, on the last stage), inference pp=2, trainer
    pp=2 x FSDP=2: every stage's slot bytes equal vLLM's adapter load into that stage model, written exactly once."""
    model = str(config_dir("vocab-llama-tied"))
    out = tmp_path / "pp-lora.plan"
    result = compile_plan(CompileOptions(model, output=out, trainer="pp=2,fsdp=2", trainer_dtype="fp32",
                                         inference="pp=2", lora="4,alpha=8,max_rank=8,targets=down_proj+embed_tokens+gate_proj+k_proj+lm_head+o_proj+q_proj+up_proj+v_proj"))
    assert result.stats["dst_coverage"] == 1.0
    plan = load_plan(out)
    assert plan.header.inference.pp == 2 and plan.header.trainer.pp == 2
    modules_of = {rank: {d.name.rsplit(".", 2)[0] for d in plan.dests if rank in d.ranks} for rank in (0, 1)}
    assert modules_of[0] == {"model.embed_tokens", *(f"model.layers.0.{m}" for m in
                             ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))}
    assert modules_of[1] == {"model.embed_tokens", "lm_head", *(f"model.layers.1.{m}" for m in
                             ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))}
    # trainer side: the embedding's adapter is on stage 0 only (ranks 0, 1), lm_head's and layer 1's on stage 1
    holders = {s.name: {r for r in range(4) if np.prod(plan.local_shape(i, r)) > 0} for i, s in enumerate(plan.sources)}
    assert holders[PEFT_EMBED] == {0, 1}
    assert holders["base_model.model.lm_head.lora_A.weight"] == {2, 3}
    assert holders["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"] == {2, 3}
    verified = verify_plan(out, model=model)
    assert verified.mismatches == () and verified.tensors == sum(len(d.ranks) for d in plan.dests)


def test_trainer_stage_of_adapter_tensors():
    """A tied model's embedding weight is on both trainer stages; its LoRA adapter only where the embedding is."""
    layout = check_trainer_stages(parse_trainer("pp=2"), {"num_hidden_layers": 2})
    names = frozenset({"model.embed_tokens.weight", PEFT_EMBED, "base_model.model.model.embed_tokens.lora_embedding_B"})
    assert layout.stages_of("model.embed_tokens.weight", names) == (0, 1)
    assert layout.stages_of(PEFT_EMBED, names) == (0,)
    assert layout.stages_of("base_model.model.model.embed_tokens.lora_embedding_B", names) == (0,)
    assert layout.stages_of("base_model.model.model.layers.1.mlp.up_proj.lora_A.weight", names) == (1,)
    assert layout.stages_of("base_model.model.lm_head.lora_B.weight", names) == (1,)

