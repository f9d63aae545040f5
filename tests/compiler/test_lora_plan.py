"""LoRA adapter plans (compile-plan --lora): one slot of vLLM's LoRA buffers, proved against vLLM's own adapter load."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from weightplan.compiler.cli import compile_main, inspect_main, verify_main
from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.frontend.lora_trace import LoraSpec
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import PlanMismatchError, load_plan
from weightplan.runtime.casts import elementwise, is_chain, scale_step

from ..conftest import config_dir


@pytest.fixture(scope="module")
def lora_plan(tmp_path_factory):
    """Rank 4 into max_lora_rank 8 (the slot's other columns are zero constants), fp32 FSDP=2 trainer, TP=2 x DP=2,
    every module vLLM takes LoRA on in Llama: the linear ones, embed_tokens and lm_head."""
    out = tmp_path_factory.mktemp("lora") / "llama-lora.plan"
    compile_plan(CompileOptions(str(config_dir("engine-llama")), output=out, trainer="fsdp=2", trainer_dtype="fp32",
                                inference="tp=2,dp=2", lora="4,alpha=12,max_rank=8,targets=down_proj+embed_tokens+gate_proj+k_proj+lm_head+o_proj+q_proj+up_proj+v_proj"))
    return out


def test_lora_plan_matches_vllm_adapter_load(lora_plan, capsys):
    """The linear modules, the embedding (PEFT's lora_embedding_A/B, A copied transposed into (slots, vocab, max_rank))
    and lm_head (vLLM's LogitsProcessorWithLoRA); the embedding's and lm_head's slots are full copies on every TP rank."""
    assert inspect_main([str(lora_plan)]) == 0
    assert "lora           rank 4, alpha 12.0, into one slot of max_lora_rank 8; targets down_proj," in capsys.readouterr().out
    plan = load_plan(lora_plan)
    lora = plan.header.inference.lora
    assert (lora.rank, lora.alpha, lora.max_rank) == (4, 12.0, 8)
    assert lora.targets == ("down_proj", "embed_tokens", "gate_proj", "k_proj", "lm_head", "o_proj", "q_proj", "up_proj", "v_proj")
    assert all(".lora_a_stacked." in d.name or ".lora_b_stacked." in d.name for d in plan.dests)
    assert {s.name.split(".")[-2] for s in plan.sources if "embed_tokens" not in s.name} == {"lora_A", "lora_B"}
    sources = {s.name: s.shape for s in plan.sources}
    assert sources["base_model.model.model.embed_tokens.lora_embedding_A"] == (4, 320)  # rank x vocab
    assert sources["base_model.model.model.embed_tokens.lora_embedding_B"] == (64, 4)  # hidden x rank
    assert sources["base_model.model.lm_head.lora_B.weight"] == (320, 4)
    dests = {d.name: d for d in plan.dests}
    assert dests["model.embed_tokens.lora_a_stacked.0"].shape == (1, 320, 8)
    assert dests["lm_head.lora_b_stacked.0"].shape == (1, 1, 320, 8)
    assert dests["model.embed_tokens.lora_a_stacked.0"].ranks == (0, 1, 2, 3)  # not split by TP
    assert len(plan.constants) > 0  # B's columns 4..7 of every slot: vLLM's reset_lora zeros, not wire bytes
    result = verify_plan(lora_plan, model=str(config_dir("engine-llama")))
    assert result.mismatches == () and result.tensors == 4 * (28 + 4)


@pytest.mark.parametrize("model, inference, modules", [
    ("tiny-qwen3-moe", "dp=2,ep", {"qkv_proj", "o_proj", "gate"}),
    ("tiny-deepseek-v3", "tp=2", {"fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate", "gate_up_proj", "down_proj"})])
def test_moe_model_lora_plans_match_vllm_adapter_load(tmp_path, model, inference, modules):
    """MoE models: attention (MLA's packed q_a/kv_a included), the router gate and dense/shared-expert MLPs take LoRA;
    routed experts do not (vLLM's FusedMoEWithLoRA needs its Triton kernel, absent on CPU). Default targets leave out
    experts, embeddings and lm_head. With EP (Qwen3-MoE, dp=2,ep) every
    rank holds every LoRA layer: only routed experts are placed by EP, and they take no LoRA here."""
    out = tmp_path / "moe-lora.plan"
    compile_plan(CompileOptions(str(config_dir(model)), output=out, inference=inference, lora="8,alpha=16"))
    plan = load_plan(out)
    assert {d.name.split(".")[-3] for d in plan.dests} == modules
    assert not {"experts", "embed_tokens", "lm_head"} & set(plan.header.inference.lora.targets)
    if "ep" in inference:
        assert plan.header.inference.ep and all(d.ranks == (0, 1) for d in plan.dests)
    result = verify_plan(out, model=str(config_dir(model)))
    assert result.mismatches == () and result.tensors == sum(len(d.ranks) for d in plan.dests)


def test_lora_verify_can_fail(lora_plan, monkeypatch):
    """A reference adapter with another alpha differs exactly in the B buffers (the scaling is folded into B, the
    embedding's and lm_head's included)."""
    from weightplan.compiler import verify_lora

    original = verify_lora.peft_config
    monkeypatch.setattr(verify_lora, "peft_config", lambda spec, targets: {**original(spec, targets), "lora_alpha": 24})
    result = verify_plan(lora_plan, model=str(config_dir("engine-llama")), ranks=[0])
    assert result.mismatches and all(".lora_b_stacked." in m for m in result.mismatches)
    assert len(result.mismatches) == 14 + 2
    assert {"model.embed_tokens.lora_b_stacked.0 (inference rank 0)", "lm_head.lora_b_stacked.0 (inference rank 0)"} \
        <= set(result.mismatches)


def test_lora_bad_inputs(capsys, lora_plan):
    llama = str(config_dir("engine-llama"))
    cases = [(["--lora", "32,max_rank=16"], "--lora rank 32 is larger than the engine's max_lora_rank 16"),
             (["--lora", "8,targets=q_proj+w_in"], "--lora targets w_in: the model has no such LoRA-capable module"),
             (["--lora", "0"], "--lora RANK 0 must be at least 1"),
             (["--lora", "8,beta=2"], "--lora: unknown field 'beta=2'"),
             (["--lora", "1024"], "--lora rank 1024 is larger than vLLM's largest max_lora_rank 512"),
             (["--lora", "8", "--quant", "fp8_per_block"], "--lora plans take the trainer's PEFT tensors as they are"),
             (["--model", str(config_dir("tiny-deepseek-v3")), "--lora", "8,targets=embed_tokens+q_b_proj"],
              "--lora targets embed_tokens: the model has no such LoRA-capable module"),
             (["--model", str(config_dir("tiny-deepseek-v3")), "--lora", "8,targets=lm_head"],
              "vLLM's DeepseekV3ForCausalLM lists no embedding_modules, so it takes no embedding or lm_head LoRA"),
             (["--model", str(config_dir("tiny-qwen3-moe")), "--lora", "8,targets=experts"],
              "--lora targets experts: routed MoE experts take LoRA only through vLLM's Triton fused-MoE LoRA kernel"),
             (["--lora", "8", "--inference", "pp=3"], "inference pp=3 is more than the model's 2 hidden layers")]
    for extra, message in cases:
        model = [] if "--model" in extra else ["--model", llama]
        assert compile_main([*model, *extra, "-o", "/tmp/never-written.plan"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    # a plan for another base model
    assert verify_main([str(lora_plan), "--model", str(config_dir("tiny-llama"))]) == 2
    assert "model config" in capsys.readouterr().err
    with pytest.raises(PlanMismatchError):
        verify_plan(lora_plan, model=str(config_dir("engine-llama")), ranks=[7])


def test_peft_config_file(tmp_path):
    (tmp_path / "adapter_config.json").write_text('{"r": 16, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}')
    assert LoraSpec.parse(str(tmp_path)) == LoraSpec(16, 32.0, ("q_proj", "v_proj"))
    (tmp_path / "adapter_config.json").write_text('{"r": 16, "use_dora": true}')
    with pytest.raises(Exception, match="DoRA"):
        LoraSpec.parse(str(tmp_path / "adapter_config.json"))


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       st.integers(0, 2**31 - 1))
def test_scale_step_is_vllms_in_place_fold(factor, dtype, seed):
    """The runtime's `scale:` step gives the bytes vLLM's `lora_b *= scaling` gives, in the value's dtype."""
    value = torch.randn(7, 5, generator=torch.Generator().manual_seed(seed)).to(dtype)
    expected = value.clone()
    expected *= factor
    step = scale_step(factor)
    assert float(step.split(":", 1)[1]) == factor
    assert torch.equal(elementwise(step)(value).view(torch.uint8), expected.view(torch.uint8))
    assert is_chain(("bfloat16", step, "bfloat16"), {"bfloat16"})


def test_scale_step_refuses_non_numbers():
    for step in ("scale:", "scale:nan", "scale:inf", "scale:x", "scale2.0"):
        assert elementwise(step) is None
