"""Architectures beyond the shipped configs: transformers' checkpoint conversion traced, plans verified against vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import Receiver, Sender, load_plan
from weightplan.runtime.errors import WeightplanError

from ..conftest import with_header_edit

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from zoo_configs import write_config  # noqa: E402

ZOO = {  # one shape per trainer-conversion family: renamed + merged experts, stacked experts with biases, Mamba
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",  # Mamba2 mixers in a hybrid: A = -exp(A_log) by a composed weight loader
    "mamba": "MambaForCausalLM",  # Mamba1 mixers: A = -exp(A_log) computed on the loaded tensor
    "bloom": "BloomForCausalLM",  # ALiBi slopes read back with .tolist() while the layer is built
    "falcon": "FalconForCausalLM",  # the same, and vLLM's MLP is 4 x hidden whatever ffn_hidden_size says
    "gemma3n_text": "Gemma3nForCausalLM",  # GeluAndMulSparse reads its std multiplier back with .item(); KV-shared layers
    "lfm2_moe": "Lfm2MoeForCausalLM",  # the class's default layer_types (None) builds nothing: zoo_configs.PER_MODEL
    "apertus": "ApertusForCausalLM",  # xIELU's beta/eps: checkpoint tensors vLLM loads into persistent buffers
    "gemma4_text": "Gemma4ForCausalLM",  # layer_scalar: a persistent buffer vLLM loads
}


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {mt: write_config(root / mt, mt, arch) for mt, arch in ZOO.items()}


def _compile(config_dir: Path, fmt: str, out: Path, **layouts) -> Path:
    compile_plan(CompileOptions(str(config_dir), fmt, "bf16", "none", out, **layouts))
    return out


@pytest.mark.parametrize("model_type", ["mixtral", *(pytest.param(m, marks=pytest.mark.extended) for m in ("gpt_oss", "lfm2_moe"))])
@pytest.mark.parametrize("fmt", ["hf", "transformers"])
def test_moe_plans_match_vllm_load_weights(zoo_dir, tmp_path, model_type, fmt):
    plan_path = _compile(zoo_dir[model_type], fmt, tmp_path / "p.plan")
    plan = load_plan(plan_path)
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=3)
    assert result.mismatches == ()
    assert result.tensors == len(plan.dests)


def test_hf_names_are_the_checkpoint_names(zoo_dir, tmp_path):
    """Mixtral's checkpoint keeps block_sparse_moe and per-expert w1/w2/w3; transformers' memory renames them."""
    hf = load_plan(_compile(zoo_dir["mixtral"], "hf", tmp_path / "hf.plan"))
    mem = load_plan(_compile(zoo_dir["mixtral"], "transformers", tmp_path / "mem.plan"))
    hf_names, mem_names = {s.name for s in hf.sources}, {s.name for s in mem.sources}
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hf_names
    assert "model.layers.0.mlp.experts.gate_up_proj" in mem_names
    assert not any(".mlp." in n for n in hf_names)


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
def test_sharded_expert_parallel_layout(zoo_dir, tmp_path, model_type):
    """fsdp=2,ep=2 trainer (in-memory stacked experts) -> vLLM dp=2 with EP: every rank verified."""
    plan_path = _compile(zoo_dir[model_type], "transformers", tmp_path / "p.plan", trainer="fsdp=2,ep=2", inference="dp=2,ep")
    plan = load_plan(plan_path)
    assert plan.header.src_ranks == 2 and plan.header.dst_ranks == 2
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=4)
    assert result.mismatches == ()


def test_stacked_is_an_alias_of_transformers(zoo_dir, tmp_path):
    a = load_plan(_compile(zoo_dir["mixtral"], "stacked", tmp_path / "a.plan"))
    b = load_plan(_compile(zoo_dir["mixtral"], "transformers", tmp_path / "b.plan"))
    assert a.sources == b.sources and a.dests == b.dests and a.header.trainer.format == "stacked"


@pytest.mark.parametrize("model_type", ["falcon_h1", "mamba"])
def test_mamba_a_is_computed_by_the_sender_equal_to_vllm_load_weights(zoo_dir, tmp_path, rendezvous, model_type):
    """vLLM's Mamba loaders write A = -exp(A_log.float()) (Mamba1 on the loaded tensor, Mamba2 on the parameter
    after the copy, via composed_weight_loader). The plan carries exp and neg in A's cast chain; the sender
    applies them while staging, so the wire carries A's final fp32 values: digests equal vLLM's load_weights,
    and a Sender/Receiver sync over NIXL lands what the host executor computes."""
    from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, plain_destination, shard

    plan_path = _compile(zoo_dir[model_type], "hf", tmp_path / "p.plan")
    plan = load_plan(plan_path)
    runs = plan.runs
    a_chains = {plan.cast_chains[int(w)] for d, w in zip(runs["dest"], runs["wire"]) if plan.dests[int(d)].name.endswith(".A")}
    assert a_chains == {("bfloat16", "float32", "exp", "neg", "float32")}
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=5)
    assert result.mismatches == () and result.tensors == len(plan.dests)

    tensors = shard(plan, full_weights(plan, 0, 1), 0)
    sender = Sender(plan, 0, tensors, rendezvous=rendezvous, timeout=10, progress="thread").start()
    destination = plain_destination(plan, 0)
    receiver = Receiver(plan, 0, destination, rendezvous=rendezvous, timeout=10, derived="caller").start()
    try:
        assert any(r.staged and len(plan.cast_chains[r.chain]) > 3 for r in sender.regions)
        sender.publish(1)
        receiver.sync(1)
    finally:
        receiver.close()
        sender.close()
    expected = host_reference(plan, full_weights(plan, 0, 1), 0)
    assert all(byte_equal(t, destination[n]) for n, t in expected.items())
    a = next(n for n in expected if n.endswith(".A"))
    assert bool((destination[a] < 0).all())  # -exp(x) is negative: the steps ran, not a plain copy of A_log


@pytest.mark.parametrize("model_type", ["bloom", *(pytest.param(m, marks=pytest.mark.extended) for m in ("falcon", "gemma3n_text"))])
def test_models_reading_constants_back_while_building_verify(zoo_dir, tmp_path, model_type):
    """vLLM computes ALiBi slopes (Gemma3n: GeluAndMulSparse's std multiplier) from the config and reads them back as
    Python numbers in __init__; built on meta they had no values ("Cannot copy out of meta tensor", "Tensor.item()
    cannot be called on meta tensors"); vllm_patches.constants_on_cpu computes them on the CPU."""
    plan_path = _compile(zoo_dir[model_type], "hf", tmp_path / "p.plan")
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=6)
    assert result.mismatches == () and result.tensors == len(load_plan(plan_path).dests)


def test_verify_materializes_parameters_vllm_holds_twice(zoo_dir):
    """verify-plan gives Mamba's conv1d.weight storage although vLLM keeps a second reference to it."""
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.compiler.verify_plan import _materialize

    model = build_model(make_vllm_config(zoo_dir["falcon_h1"]))
    names = {n for n, _ in model.named_parameters() if n.endswith("conv1d.weight")}
    params = _materialize(model, names, fill=1.0)
    assert names and set(params) == names
    assert all(p.device.type == "cpu" and bool((p == 1).all()) for p in params.values())
    held = dict(model.named_parameters())
    assert all(held[n] is params[n] for n in names)


def test_loader_refusal_is_one_line(tmp_path):
    """A checkpoint vLLM's loader refuses (transformers builds another architecture's names) is one error line."""
    import json

    config_dir = write_config(tmp_path / "mixed", "qwen3_moe", "Qwen3MoeForCausalLM")
    config = json.loads((config_dir / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (config_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightplanError) as info:
        _compile(config_dir, "hf", tmp_path / "p.plan")
    assert "\n" not in str(info.value) and "load_weights" in str(info.value)


@pytest.mark.parametrize("model_type, architecture", [
    ("dbrx", "DbrxForCausalLM"), ("gemma3n_text", "Gemma3nForCausalLM"), ("gemma4_text", "Gemma4ForCausalLM"),
    ("lfm2_moe", "Lfm2MoeForCausalLM"), ("qwen4_exp", "Qwen4ExpForCausalLM"), ("qwen4_exp_text", "Qwen4ExpForCausalLM"),
])
def test_tiny_configs_build_the_trainer_model(tmp_path, model_type, architecture):
    """Config classes whose defaults (or shrunk values) transformers' model refuses get per-model values (PER_MODEL);
    Gemma4's per_layer_config, keyed by layer index, is derived again for the cut layer list."""
    from weightplan.compiler.frontend.trainer_formats import TrainerFormat, load_trainer_model

    config_dir = write_config(tmp_path / model_type, model_type, architecture)
    assert load_trainer_model(config_dir, torch.bfloat16).specs(TrainerFormat.HF)


@pytest.fixture(scope="module")
def laguna_plan(tmp_path_factory):
    config_dir = write_config(tmp_path_factory.mktemp("laguna"), "laguna", "LagunaForCausalLM")
    return config_dir, _compile(config_dir, "hf", config_dir / "p.plan")


BIAS = "model.layers.1.mlp.experts.routed_experts.e_score_correction_bias"


def test_parameters_vllm_never_loads_are_listed_and_verified(laguna_plan):
    """Laguna's checkpoint bias never reaches vLLM's routed_experts.e_score_correction_bias (vLLM's AutoWeightsLoader
    skips it; vLLM's own loader accepts that: the MoE module has a quant method). vLLM serves it at its initial value,
    so the plan does not write it: it is listed in the header (inference.unloaded), shown by inspect-plan, and
    verify-plan checks that vLLM's own load leaves it untouched too."""
    from weightplan.compiler.plan_summary import render_text, summarize

    config_dir, plan_path = laguna_plan
    plan = load_plan(plan_path)
    assert [(e.name, e.ranks) for e in plan.unloaded] == [(BIAS, (0,))]
    assert BIAS not in {e.name for e in plan.dests}
    assert BIAS in render_text(plan, summarize(plan)) and "never writes" in render_text(plan, summarize(plan))
    result = verify_plan(plan_path, model=str(config_dir), seed=7)
    assert result.mismatches == () and result.tensors == len(plan.dests) and result.unloaded == 1


def test_a_model_with_unloaded_parameters_is_a_valid_destination(laguna_plan):
    """Executing the plan into vLLM's model itself: the parameter the plan leaves alone is known, not "not in the plan"."""
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.runtime import execute_local

    from weightplan.testing.runtime_worker import full_weights, shard

    config_dir, plan_path = laguna_plan
    plan = load_plan(plan_path)
    model = build_model(make_vllm_config(config_dir), "cpu")
    before = dict(model.named_parameters())[BIAS].clone()
    assert execute_local(plan, {0: shard(plan, full_weights(plan, 0, 1), 0)}, {0: model}) > 0
    assert torch.equal(dict(model.named_parameters())[BIAS], before)


def test_verify_refuses_a_parameter_listed_unloaded_that_vllm_writes(laguna_plan, monkeypatch):
    """The differential check is not weakened: a parameter the plan lists as never written but vLLM's load writes
    is a mismatch."""
    from weightplan.runtime.plan.format import Plan
    from weightplan.runtime.plan.schema import TensorEntry

    config_dir, plan_path = laguna_plan
    monkeypatch.setattr(Plan, "unloaded", property(lambda self: (TensorEntry("model.norm.weight", (64,), "bfloat16", ranks=(0,)),)))
    result = verify_plan(plan_path, model=str(config_dir), seed=7)
    assert result.mismatches == ("model.norm.weight (inference rank 0, listed as never written)",)


def test_parameters_vllm_refuses_to_leave_unwritten_are_refused_in_one_line(tmp_path):
    """AXK1's dense layer 0 has a post_mlp_layernorm in vLLM that transformers' checkpoint does not hold; vLLM's own
    loader refuses that checkpoint ("weights were not initialized from checkpoint"), and so does the compiler."""
    from weightplan.compiler.frontend.errors import UnloadedParameterError

    config_dir = write_config(tmp_path / "axk1", "axk1", "AXK1ForCausalLM")
    with pytest.raises(UnloadedParameterError) as info:
        _compile(config_dir, "hf", tmp_path / "p.plan")
    assert "\n" not in str(info.value) and "model.layers.0.post_mlp_layernorm.weight" in str(info.value)
    assert not (tmp_path / "p.plan").exists()


def test_unloaded_header_rows_are_checked(laguna_plan):
    """The reader refuses an `inference.unloaded` row that is malformed or names a destination of the same rank."""
    from weightplan.runtime.errors import PlanFormatError
    from weightplan.runtime.plan.format import decode_plan

    plan = load_plan(laguna_plan[1])
    for rows, message in (([["x", [4], "float32"]], "is not [name, shape, dtype, inference ranks]"),
                          ([plan.dests[0].dest_row()], "a destination of the plan on the same inference rank")):
        data = with_header_edit(Path(laguna_plan[1]).read_bytes(), lambda header: header["inference"].update(unloaded=rows))
        with pytest.raises(PlanFormatError, match=message.replace("[", r"\[").replace("]", r"\]")):
            decode_plan(data)


@pytest.mark.parametrize("model_type, buffer", [("apertus", "model.layers.1.mlp.act_fn.beta"),
                                                ("gemma4_text", "model.layers.1.layer_scalar")])
def test_persistent_buffers_vllm_loads_are_destinations(zoo_dir, tmp_path, model_type, buffer):
    """vLLM's AutoWeightsLoader copies checkpoint tensors into persistent buffers (xIELU's beta/eps, Gemma4's
    layer_scalar) as into parameters: the plan writes them too (layer 1 through its template layer 0), and
    verify-plan compares their digests with vLLM's own load like every parameter's."""
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config
    from weightplan.runtime import execute_local
    from weightplan.runtime.checks import named_tensors

    from weightplan.testing.runtime_worker import byte_equal, full_weights, host_reference, shard

    plan_path = _compile(zoo_dir[model_type], "hf", tmp_path / "p.plan")
    plan = load_plan(plan_path)
    assert buffer in {e.name for e in plan.dests}
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=8)
    assert result.mismatches == () and result.tensors == len(plan.dests)
    assert f"{buffer} (inference rank 0)" in result.compared
    model = build_model(make_vllm_config(zoo_dir[model_type]), "cpu")  # vLLM's model itself as the destination
    full = full_weights(plan, 0, 1)
    assert execute_local(plan, {0: shard(plan, full, 0)}, {0: model}) > 0
    expected = host_reference(plan, full, 0)[buffer]
    assert byte_equal(named_tensors(model, {buffer})[buffer], expected) and not byte_equal(expected, torch.zeros_like(expected))


def test_unloaded_parameters_merge_over_ranks(laguna_plan, tmp_path):
    """fsdp=2 (in-memory format) -> dp=2 with EP: the bias is unloaded on both inference ranks, one header row."""
    config_dir, _ = laguna_plan
    plan_path = _compile(config_dir, "transformers", tmp_path / "p.plan", trainer="fsdp=2", inference="dp=2,ep")
    assert [(e.name, e.ranks) for e in load_plan(plan_path).unloaded] == [(BIAS, (0, 1))]
    result = verify_plan(plan_path, model=str(config_dir), seed=9)
    assert result.mismatches == () and result.unloaded == 2
