"""The weightplan vLLM backend without an engine: registration, init info validation, mode choice, all-or-nothing apply."""

from __future__ import annotations

import pytest
import torch

from weightplan.runtime import Plan


class Norms(torch.nn.Module):
    """A module whose parameters are what its kernel uses (no quant method): direct mode on any platform."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)


class UnknownMethod:
    def process_weights_after_loading(self, layer):
        raise AssertionError("never called: unknown methods are refused first")


class Packed(torch.nn.Module):
    def __init__(self, method):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
        self.quant_method = method


def fake_plan(entries) -> Plan:
    from types import SimpleNamespace

    from weightplan.runtime.plan.schema import TensorEntry

    return SimpleNamespace(dests=tuple(TensorEntry(n, s, "float32") for n, s in entries))


def test_registration_is_idempotent_and_lazy():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from weightplan.vllm_backend.plugin import register

    register()
    register()  # plugins load several times per process: the factories' duplicate-name error must not escape
    assert WeightTransferEngineFactory._registry["weightplan"]().__name__ == "WeightplanWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["weightplan"]().__name__ == "WeightplanTrainerEngine"


@pytest.mark.parametrize("field,value", [("plan", 3), ("plan", []), ("address", "host"), ("job", ""), ("timeout", 0),
                                         ("timeout", True), ("verify", 1), ("rank_offset", -1), ("mode", "fast"),
                                         ("fingerprint", 5), ("extra", 1), ("draft_plan", 3), ("draft_plan", []),
                                         ("draft_plan", ""), ("draft_plan", ["d.plan", 1]), ("address", "h:99999"),
                                         ("address", "h:\uff11\uff12"), ("job", "../x"), ("job", "a\nb"), ("job", "j" * 1000),
                                         ("rank_offset", 10**30), ("rank_offset", 4096), ("plan", "p\0.plan"),
                                         ("draft_plan", ["d\0.plan"]), ("plan", "p" * 5000), ("pool_ranks", 0),
                                         ("pool_ranks", 2.0), ("pool_ranks", True), ("pool_ranks", 10**9)])
def test_bad_init_info_names_the_field(field, value):
    from weightplan.vllm_backend.init_info import InitInfoError, WeightplanInitInfo

    good = {"plan": "p.plan", "address": "127.0.0.1:1", "job": "j"}
    assert WeightplanInitInfo.from_dict(good).plans == ["p.plan"]
    with pytest.raises(InitInfoError, match=f"field '{field}'") as info:
        WeightplanInitInfo.from_dict({**good, field: value})
    assert "\n" not in str(info.value) and len(str(info.value)) < 500
    with pytest.raises(InitInfoError, match="field 'job' is required"):
        WeightplanInitInfo.from_dict({"plan": "p", "address": "h:1"})


def test_pool_ranks_is_optional_and_reaches_the_workers_from_the_trainers_init_info():
    from weightplan.vllm_backend.init_info import WeightplanInitInfo
    from weightplan.vllm_backend.trainer import WeightplanTrainerInitInfo

    good = {"plan": "p.plan", "address": "127.0.0.1:1", "job": "j"}
    assert WeightplanInitInfo.from_dict(good).pool_ranks is None
    trainer = WeightplanTrainerInitInfo(rank=0, plan="p.plan", address="127.0.0.1:1", job="j", pool_ranks=8)
    assert WeightplanInitInfo.from_dict(trainer.worker_init_info("f" * 64)).pool_ranks == 8
    assert "pool_ranks" not in WeightplanTrainerInitInfo(rank=0, plan="p.plan").worker_init_info("f" * 64)


def test_draft_plan_is_optional_and_syncs_in_its_own_job():
    from weightplan.vllm_backend.init_info import InitInfoError, WeightplanInitInfo

    good = {"plan": "p.plan", "address": "127.0.0.1:1", "job": "run-1"}
    assert WeightplanInitInfo.from_dict(good).draft_plans == []
    info = WeightplanInitInfo.from_dict({**good, "draft_plan": "d.plan"})
    assert info.draft_plans == ["d.plan"] and info.draft_job == "run-1.draft"
    with pytest.raises(InitInfoError, match="field 'draft_plan' syncs in job .* shorten field 'job'"):
        WeightplanInitInfo.from_dict({**good, "job": "j" * 60, "draft_plan": "d.plan"})


def test_update_info_is_one_positive_version_and_an_optional_prefetch():
    from weightplan.vllm_backend.init_info import InitInfoError, WeightplanInitInfo, WeightplanUpdateInfo

    assert WeightplanUpdateInfo.from_dict({"version": 3}) == WeightplanUpdateInfo(3, prefetch=False)
    assert WeightplanUpdateInfo.from_dict({"version": 3, "prefetch": True}).prefetch
    assert WeightplanUpdateInfo.from_dict({"version": 2**62 - 1}).version == 2**62 - 1
    good = {"plan": "p.plan", "address": "127.0.0.1:1", "job": "j"}
    assert WeightplanInitInfo.from_dict(good).delta == 0.0 and WeightplanInitInfo.from_dict({**good, "delta": 0.5}).delta == 0.5
    for bad in (-0.1, 1.5, True, "0.5"):
        with pytest.raises(InitInfoError, match="field 'delta' must be a number in \\[0, 1\\]"):
            WeightplanInitInfo.from_dict({**good, "delta": bad})
    for bad in ({"version": 0}, {"version": "3"}, {"version": 3, "x": 1}, [3], {"version": 2**62}, {"prefetch": True},
                {"version": 3, "prefetch": 1}):
        with pytest.raises(InitInfoError):
            WeightplanUpdateInfo.from_dict(bad)


def test_mode_choice_direct_for_plain_parameters_staged_when_asked_or_packed():
    from weightplan.vllm_backend.staging import choose

    model = Norms()
    plan = fake_plan([("a", (4,)), ("b", (2, 3))])
    direct = choose(plan, ["a", "b"], model, "cpu", "auto")
    assert direct.mode == "direct" and direct.tensors["a"].data_ptr() == model.a.data_ptr()
    staged = choose(plan, ["a", "b"], model, "cpu", "staged")
    assert staged.mode == "staged" and staged.tensors["a"].data_ptr() != model.a.data_ptr()
    staged.tensors["b"].fill_(5.0)
    staged.tensors["a"].fill_(1.0)
    assert model.b.sum() == 0  # the engine serves the previous weights until apply()
    staged.apply()
    assert torch.equal(model.b, torch.full((2, 3), 5.0))
    packed = torch.nn.Module()
    packed.layer = Packed(UnknownMethod())
    with pytest.raises(ValueError, match="field 'mode' is 'direct'"):
        choose(fake_plan([("layer.weight", (2, 2))]), ["layer.weight"], packed, "cpu", "direct")


def test_a_failed_rebuild_restores_every_layer_already_rebuilt():
    from weightplan.vllm_backend.live_patches import rebuild
    from weightplan.vllm_backend.staging import Destination

    class Linear:  # stands for UnquantizedLinearMethod: packs into a closure and empties `weight`
        def process_weights_after_loading(self, layer):
            packed = layer.weight.detach().clone()
            layer.cpu_linear = lambda x: x @ packed.t()
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    Linear.__name__ = "UnquantizedLinearMethod"
    first, second = Packed(Linear()), Packed(UnknownMethod())
    first.quant_method.process_weights_after_loading(first)
    old_closure, old_weight = first.cpu_linear, first.weight
    dest = Destination("staged", {}, "test", rebuilt={"first": {"weight": torch.full((2, 2), 3.0)},
                                                      "second": {"weight": torch.zeros(2, 2)}},
                       modules={"first": first, "second": second})
    with pytest.raises(NotImplementedError, match="UnknownMethod"):
        dest.apply()
    assert first.cpu_linear is old_closure and first.weight is old_weight and torch.equal(second.weight, torch.ones(2, 2))
    rebuild(first, {"weight": torch.full((2, 2), 3.0)})
    assert torch.equal(first.cpu_linear(torch.eye(2)), torch.full((2, 2), 3.0)) and first.weight.numel() == 0


def test_trainer_engine_takes_a_draft_source_exactly_with_a_draft_plan():
    from weightplan.vllm_backend.trainer import ShardSource, WeightplanTrainerEngine, WeightplanTrainerInitInfo

    info = WeightplanTrainerInitInfo(rank=0, plan="p.plan", job="run", draft_plan="d.plan")
    assert info.worker_init_info("f")["draft_plan"] == "d.plan"
    assert "draft_plan" not in WeightplanTrainerInitInfo(rank=0, plan="p.plan").worker_init_info("f")
    with pytest.raises(TypeError, match="draft_source"):
        WeightplanTrainerEngine.trainer_init(info, client=None, source=ShardSource({}))
    with pytest.raises(TypeError, match="draft_source"):
        WeightplanTrainerEngine.trainer_init(WeightplanTrainerInitInfo(rank=0, plan="p.plan"), client=None,
                                             source=ShardSource({}), draft_source=ShardSource({}))


def _lora_engine(model: str, *, max_rank: int, slots: int):
    """(vllm_config, LoRA model manager) of a CPU engine of `model` started with enable_lora (rank-8 targets)."""
    from weightplan.compiler.frontend.lora_trace import LoraSpec, enable_lora, lora_model
    from weightplan.compiler.frontend.vllm_model import make_vllm_config

    from ..conftest import config_dir

    config = make_vllm_config(config_dir(model))
    enable_lora(config, LoraSpec(8, 16.0, None, max_rank), None, slots=slots)
    return config, lora_model(config, device="cpu")[1]


def test_lora_plans_are_refused_in_one_line_by_engines_they_do_not_fit(tmp_path):
    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.runtime import PlanMismatchError, load_plan
    from weightplan.vllm_backend.engine_check import check_lora_engine
    from weightplan.vllm_backend.init_info import InitInfoError, WeightplanInitInfo
    from weightplan.vllm_backend.lora_update import LoraSide

    from ..conftest import config_dir

    plans = {}
    for name, model, lora in (("fits", "engine-llama", "8,alpha=16"), ("rank16", "engine-llama", "16,alpha=16"),
                              ("other", "vocab-llama", "8,alpha=16"),
                              ("embed", "engine-llama", "8,alpha=16,targets=embed_tokens+lm_head"),
                              ("other_embed", "vocab-llama", "8,alpha=16,targets=embed_tokens")):
        compile_plan(CompileOptions(str(config_dir(model)), output=tmp_path / f"{name}.plan", lora=lora))
        plans[name] = load_plan(tmp_path / f"{name}.plan")
    config, manager = _lora_engine("engine-llama", max_rank=8, slots=2)
    check_lora_engine(plans["fits"], 0, config, "cpu", manager)
    check_lora_engine(plans["embed"], 0, config, "cpu", manager)  # vLLM's default engine wraps embeddings and lm_head
    refusals = {"rank16": "adapter rank 16 is larger than the engine's max_lora_rank 8",
                "other": "a plan for another base model: .* LoRA layers differ, e.g. model.layers.0",
                "other_embed": "LoRA layers differ, e.g. model.embed_tokens.lora_a_stacked.0: plan 999, engine 320"}
    for name, message in refusals.items():
        with pytest.raises(PlanMismatchError, match=message) as info:
            check_lora_engine(plans[name], 0, config, "cpu", manager)
        assert "\n" not in str(info.value)
    one_slot_config, one_slot_manager = _lora_engine("engine-llama", max_rank=8, slots=1)
    with pytest.raises(PlanMismatchError, match="max_loras 1: LoRA updates alternate between two slots"):
        check_lora_engine(plans["fits"], 0, one_slot_config, "cpu", one_slot_manager)
    with pytest.raises(PlanMismatchError, match="LoRA slot 2 is out of range: the engine has 2 slots"):
        LoraSide(plans["fits"], 0, manager, None, timeout=1, verify=False, slots=(0, 2))
    assert manager.lora_index_to_id == [None, None]  # the refusals routed nothing
    for bad in ([0, 0], [1], [0, -1], "01", [0, True]):
        with pytest.raises(InitInfoError, match="field 'lora_slots' must be two different slot indices"):
            WeightplanInitInfo.from_dict({"plan": "p.plan", "address": "127.0.0.1:1", "job": "j", "lora_slots": bad})


def test_importing_the_backend_loads_no_numba():
    """vLLM's CPU worker scans sys.modules when it starts (`triton_utils/dispatcher.py:_rebind_kernels`) and fails on
    llvmlite's `ffi.lib`; the backend is imported before that scan, so numba must load only when a kernel is used."""
    import subprocess
    import sys

    code = ("import sys, weightplan.runtime, weightplan.vllm_backend.engine, weightplan.vllm_backend.trainer; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_finish_update_names_the_version_only_to_a_client_that_takes_it():
    """vLLM 0.26's clients (HTTP, Ray, LLM.finish_weight_update) take no weight version; 0.30's and 0.32's do."""
    from weightplan.vllm_backend.clients import finish_update

    calls = []

    class Old:
        def finish_weight_update(self) -> None:
            calls.append(("old",))

    class New:
        def finish_weight_update(self, weight_version: str | None = None) -> None:
            calls.append(("new", weight_version))

    finish_update(Old(), 3)
    finish_update(New(), 4)
    assert calls == [("old",), ("new", "4")]
