"""Architectures beyond the shipped configs: transformers' checkpoint conversion traced, plans verified against vLLM."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from weightplan.compiler.compile import CompileOptions, compile_plan
from weightplan.compiler.verify_plan import verify_plan
from weightplan.runtime import load_plan
from weightplan.runtime.errors import WeightplanError

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from zoo_configs import write_config  # noqa: E402

ZOO = {  # one shape per trainer-conversion family: renamed + merged experts, stacked experts with biases, Mamba hybrid
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
}


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {mt: write_config(root / mt, mt, arch) for mt, arch in ZOO.items()}


def _compile(config_dir: Path, fmt: str, out: Path, **layouts) -> Path:
    compile_plan(CompileOptions(str(config_dir), fmt, "bf16", "none", out, **layouts))
    return out


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss"])
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
    assert plan.header["src_ranks"] == 2 and plan.header["dst_ranks"] == 2
    result = verify_plan(plan_path, model=str(zoo_dir[model_type]), seed=4)
    assert result.mismatches == ()


def test_stacked_is_an_alias_of_transformers(zoo_dir, tmp_path):
    a = load_plan(_compile(zoo_dir["mixtral"], "stacked", tmp_path / "a.plan"))
    b = load_plan(_compile(zoo_dir["mixtral"], "transformers", tmp_path / "b.plan"))
    assert a.sources == b.sources and a.dests == b.dests and a.header["trainer"]["format"] == "stacked"


def test_mamba_hybrid_is_refused_naming_the_parameter_vllm_computes(zoo_dir, tmp_path):
    """vLLM's Mamba loader writes A = -exp(A_log) into the parameter after the copy, on the parameter
    itself: a computation, not a data movement. The tracer sees that write and refuses the model,
    naming A, instead of writing a plan that would carry A_log's bytes into A.
    """
    from weightplan.compiler.frontend.errors import ConstantWriteError

    out = tmp_path / "p.plan"
    with pytest.raises(ConstantWriteError, match=r"copy_ into parameter 'model\.layers\.0\.mamba\.mamba\.A' .*A_log") as info:
        _compile(zoo_dir["falcon_h1"], "hf", out)
    assert "cannot compute on loaded values" in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


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
