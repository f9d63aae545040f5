"""The backend's mode choice for engines on GPUs, without a GPU: direct where vLLM's GPU post-load step keeps the
loaded tensor, a one-line refusal of direct mode where it replaces or re-lays it (staged then)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from weightplan.vllm_backend.staging import choose


def _method(name: str):
    return type(name, (), {"process_weights_after_loading": lambda self, layer: None})()


class Layer(torch.nn.Module):
    def __init__(self, method, shape=(4, 4)):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.quant_method = method


def _model(**methods) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, method in methods.items():
        setattr(model, name, Layer(_method(method)))
    return model


def _plan(names):
    from weightplan.runtime.plan.schema import TensorEntry

    return SimpleNamespace(dests=tuple(TensorEntry(f"{n}.weight", (4, 4), "float32") for n in names))


def test_unquantized_linears_and_embeddings_on_cuda_are_written_in_place():
    model = _model(proj="UnquantizedLinearMethod", embed="UnquantizedEmbeddingMethod")
    names = ["proj.weight", "embed.weight"]
    for requested in ("auto", "direct"):
        d = choose(_plan(["proj", "embed"]), names, model, "cuda", requested)
        assert d.mode == "direct" and d.tensors["proj.weight"].data_ptr() == model.proj.weight.data_ptr()
    # the same layers on the CPU engine are packed after loading: staged
    assert choose(_plan(["proj", "embed"]), names, model, "cpu", "auto").mode == "staged"


@pytest.mark.parametrize("method, says", [
    ("Fp8LinearMethod", "re-lays the block scales"),
    ("UnquantizedFusedMoEMethod", "keeps w13/w2 with the Triton backend, but shuffles them"),
    ("SomeNewMethod", "is not known to keep it as loaded"),
])
def test_direct_mode_is_refused_in_one_line_where_the_gpu_post_load_step_replaces_the_tensor(method, says):
    model = _model(proj="UnquantizedLinearMethod", experts=method)
    names = ["proj.weight", "experts.weight"]
    with pytest.raises(ValueError, match=rf"mode' is 'direct'.*experts.weight of Layer, whose post-load step \({method}\) {says}") as err:
        choose(_plan(["proj", "experts"]), names, model, "cuda", "direct")
    assert "\n" not in str(err.value) and "use mode 'staged' or 'auto'" in str(err.value)
    staged = choose(_plan(["proj", "experts"]), names, model, "cuda", "auto")
    assert staged.mode == "staged" and "re-lays them out on cuda" in staged.reason
    assert staged.tensors["experts.weight"].data_ptr() != model.experts.weight.data_ptr()


def test_a_live_tensor_not_laid_out_as_planned_refuses_direct_mode():
    model = torch.nn.Module()
    model.norm = torch.nn.Module()
    model.norm.weight = torch.nn.Parameter(torch.zeros(4, 4).t(), requires_grad=False)  # not contiguous
    with pytest.raises(ValueError, match="not laid out as the plan's destination"):
        choose(_plan(["norm"]), ["norm.weight"], model, "cuda", "direct")


def test_staging_buffers_live_on_the_parameters_device():
    model = _model(experts="UnquantizedFusedMoEMethod")
    staged = choose(_plan(["experts"]), ["experts.weight"], model, "cuda", "staged")
    assert staged.tensors["experts.weight"].device == model.experts.weight.device
