"""The traced trainer -> checkpoint conversion equals transformers' own save_pretrained on real random tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from weightplan.compiler.frontend.lazy_weight import LazyWeight, WriteRecorder, tracing
from weightplan.compiler.frontend.trainer_formats import TrainerFormat, load_trainer_model
from weightplan.compiler.passes.fold_views import _evaluate

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from zoo_configs import write_config  # noqa: E402

# Conversion families: renames + merged experts (mixtral), merged experts (qwen2_moe family), none (gpt_oss).
MODELS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _saved(model, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(directory)
    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model_type=st.sampled_from(sorted(MODELS)), seed=st.integers(0, 2**16), dtype=st.sampled_from(["bf16", "fp32"]))
def test_traced_conversion_is_save_pretrained(tmp_path_factory, model_type, seed, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    root = tmp_path_factory.mktemp(model_type)
    config_dir = write_config(root / "config", model_type, MODELS[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)), dtype=torch_dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float32).to(torch_dtype))
    expected = _saved(model, root / "saved")

    trainer = load_trainer_model(config_dir, torch_dtype)
    state = model.state_dict()
    real = dict(trainer.checkpoint_tensors(TrainerFormat.TRANSFORMERS, ((n, state[n]) for n in trainer.in_memory)))
    assert list(real) == list(trainer.checkpoint)  # the feeding order the specs promise
    assert set(real) == set(expected)
    for name, tensor in real.items():
        assert tensor.dtype == expected[name].dtype and tensor.shape == expected[name].shape, name
        assert torch.equal(tensor.contiguous().view(torch.uint8), expected[name].contiguous().view(torch.uint8)), name

    # The same conversion traced on LazyWeights: its recorded chains, replayed on the trainer's
    # bytes (fold_views' index evaluator), give save_pretrained's tensors too.
    with tracing(WriteRecorder({})):
        lazy = {n: LazyWeight.source(n, tuple(t.shape), t.dtype) for n, t in trainer.in_memory.items()}
        traced = dict(trainer.checkpoint_tensors(TrainerFormat.TRANSFORMERS, lazy.items()))
    assert list(traced) == list(real)
    bases, flat, offset = {}, [], 0
    for name in trainer.in_memory:
        bases[name], offset = offset, offset + state[name].numel()
        flat.append(state[name].reshape(-1))
    flat = torch.cat(flat)
    for name, tensor in traced.items():
        index = _evaluate(tensor.node, bases, [()])[..., 0]
        assert torch.equal(flat[index].view(torch.uint8), expected[name].contiguous().view(torch.uint8)), name
