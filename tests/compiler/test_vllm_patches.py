"""The vLLM patch inventory: every target exists in the installed vLLM, every patch restores, and plans do not depend on the host CPU."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from weightplan.compiler.frontend import vllm_patches
from weightplan.compiler.frontend.vllm_patches import CPU_FEATURES, OTHER_CPU_PROBES, PATCHES, exists, resolve

from ..conftest import config_dir
from ..support.vllm_inventory import holds_on_installed_vllm

REPO = Path(__file__).resolve().parents[2]


def _has_cpu_mla() -> bool:
    return exists("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_MLA")


needs_cpu_mla = pytest.mark.skipif("not _has_cpu_mla()", reason="this vLLM's CPU platform has no MLA backend (vLLM 0.26): "
                                                                "MLA models are refused there")


@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_every_patched_target_exists_in_the_installed_vllm(patch):
    """A patch that applies to the installed vLLM finds every target; one that does not finds some target missing
    (else its declared versions leave out a vLLM it should patch)."""
    import vllm

    assert patch.why
    assert vllm_patches.installed_vllm() == vllm.__version__, "the installed vLLM is outside SUPPORTED_VLLM"
    if not patch.applies_on(vllm_patches.trace_platform()):
        pytest.skip(f"{patch.name} applies on {', '.join(patch.platforms)}; this traces on {vllm_patches.trace_platform()}")
    holds_on_installed_vllm(patch, patch.targets + patch.reads, "compiler/frontend/vllm_patches.py")


def test_an_unsupported_vllm_is_refused_in_one_line_naming_the_supported_range(monkeypatch):
    import vllm

    for version in ("0.25.1", "0.29.0", "0.33.0"):  # below, between the tested releases, above
        monkeypatch.setattr(vllm, "__version__", version)
        with pytest.raises(vllm_patches.UnsupportedVllm) as refused:
            vllm_patches.installed_vllm("compile-plan")
        assert str(refused.value) == (f"compile-plan supports vLLM {vllm_patches.SUPPORTED_VLLM}; this is vLLM {version} "
                                      "(docs/install.md lists the versions and what they were tested with)")
    for version in ("0.26.0", "0.30.0", "0.32.1.dev7+g0123abc.cpu"):  # the oldest; 0.30; a patch release or a nightly of 0.32
        monkeypatch.setattr(vllm, "__version__", version)
        assert vllm_patches.installed_vllm() == version


def test_a_patch_leaves_a_vllm_outside_its_versions_alone(monkeypatch):
    import vllm

    target = "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm"
    original = getattr(*resolve(target))
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with vllm_patches.plain_cpu_gemm():
        assert getattr(*resolve(target)) is original and vllm_patches.active_targets() == ()
    monkeypatch.undo()
    with vllm_patches.plain_cpu_gemm():
        assert getattr(*resolve(target)) is not original


def test_the_layer_registry_the_compiler_clears_exists():
    from weightplan.compiler.frontend.vllm_model import make_vllm_config

    config = make_vllm_config(config_dir("tiny-llama"))
    assert isinstance(config.compilation_config.static_forward_context, dict)


def test_building_a_model_forgets_vllms_cache_of_pipeline_missing_layers():
    """vLLM caches PPMissingLayer names by id(model): a model reusing a freed model's id would inherit its stage."""
    from vllm.model_executor.models import utils

    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

    freed = 1  # no live object has id 1: stands for a model freed after its stage was cached
    utils._model_to_pp_missing_layer_names[freed] = ["model.embed_tokens"]
    build_model(make_vllm_config(config_dir("tiny-llama"), pp=2), pp_rank=0)
    assert freed not in utils._model_to_pp_missing_layer_names


def _snapshot(targets):
    return {target: (lambda owner, attr: (owner.__dict__.get(attr, "<inherited>"), getattr(owner, attr)))(*resolve(target))
            for target in targets}


@pytest.mark.parametrize("name", ["pinned_cpu_features", "pinned_amx_fp8_probes", "dense_mla_backend", "plain_cpu_gemm",
                                  "expert_maps_on_cpu", "triton_fp8_kernels", "constants_on_cpu",
                                  "elementwise_composed_loaders", "transformers_classes_untouched"])
def test_each_patch_changes_its_targets_and_restores_them_even_on_error(name):
    import vllm

    patch = next(p for p in PATCHES if p.name == name)
    if not patch.applies_to(vllm.__version__):
        pytest.skip(f"{name} declares vLLM {patch.vllm_versions}, not the installed {vllm.__version__}")
    if not patch.applies_on(vllm_patches.trace_platform()):
        pytest.skip(f"{name} applies on {', '.join(patch.platforms)}, not {vllm_patches.trace_platform()}")
    replaced = patch.targets
    before = _snapshot(replaced)
    with pytest.raises(RuntimeError, match="inside"):
        with patch.enter():
            during = _snapshot(replaced)
            assert all(during[t][1] is not before[t][1] for t in replaced), "a listed target was not replaced"
            raise RuntimeError("inside")
    assert _snapshot(replaced) == before


def test_nested_pins_restore_the_host_answers():
    host = torch.cpu._is_amx_tile_supported
    with vllm_patches.host_independent():
        with vllm_patches.host_independent():
            assert torch.cpu._is_amx_tile_supported() is False
        assert torch.cpu._is_amx_tile_supported() is False
    assert torch.cpu._is_amx_tile_supported is host


@contextlib.contextmanager
def fake_host(monkeypatch, has_features: bool):
    """Make every CPU feature probe vLLM reads answer `has_features` (AMX, AVX-512, AMX fp8, Zen) outside the pins.

    vLLM's kernel library is loaded first, for the real host: faking features at that import would
    load a library this CPU may not run.
    """
    vllm_patches.import_host_kernels()
    with monkeypatch.context() as patch:
        for name in CPU_FEATURES:
            patch.setattr(torch.cpu, name, lambda value=has_features: value)
        for target in filter(exists, OTHER_CPU_PROBES):  # vLLM 0.26 has no AMX fp8 probes
            owner, attribute = resolve(target)
            patch.setattr(owner, attribute, lambda *args, value=has_features, **kwargs: value)
        yield


def test_vllm_block_quantization_runs_eagerly_inside_the_pins():
    """Inductor compiles per_block_cast_to_fp8 for the host's ISA; inside the pins vLLM's online fp8 calls it under the
    force_eager stance, with the bytes of vLLM's compiled function on this host."""
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    compiled = online_fp8.per_block_cast_to_fp8
    stances = []
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with vllm_patches.host_independent(), contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).setattr(
            torch.compiler, "set_stance", lambda stance, _set=torch.compiler.set_stance: stances.append(stance) or _set(stance))
        values, scales = online_fp8.per_block_cast_to_fp8(x, block_size=[128, 128], use_ue8m0=False)
    assert stances == ["force_eager"]
    compiled_values, compiled_scales = compiled(x, block_size=[128, 128], use_ue8m0=False)  # vLLM's own, compiled, outside the pins
    assert torch.equal(values.view(torch.uint8), compiled_values.view(torch.uint8)) and torch.equal(scales, compiled_scales)
    assert online_fp8.per_block_cast_to_fp8 is compiled  # restored on exit


def test_pins_answer_the_same_on_every_host(monkeypatch):
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # noqa: F401  (import before faking)
    from vllm.platforms import current_platform

    answers = []
    for has_features in (True, False):
        with fake_host(monkeypatch, has_features), vllm_patches.host_independent():
            answers.append(({name: getattr(torch.cpu, name)() for name in CPU_FEATURES}, current_platform.is_zen_cpu(),
                            resolve(OTHER_CPU_PROBES[0])[0].cpu_has_amx_fp8() if exists(OTHER_CPU_PROBES[0]) else False))
    assert answers[0] == answers[1] == (CPU_FEATURES, False, False)


@needs_cpu_mla
def test_an_amx_host_builds_glm_attention_with_cpu_mla(monkeypatch):
    """On an AMX host vLLM picks AMX_MLA, which refuses GLM-5.2's topk_indices_buffer; the build must not see it."""
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

    with fake_host(monkeypatch, True):
        model = build_model(make_vllm_config(config_dir("tiny-glm")))
    impls = {type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")}
    assert impls and all("AMX" not in name for name in impls), impls


def test_cpu_gemm_keeps_the_loaded_weight_whatever_the_host(monkeypatch):
    """vLLM's CPU post-load packs unquantized linears (sgl-kernel on AMX, oneDNN otherwise) and empties `weight`."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from weightplan.compiler.frontend.vllm_model import ensure_single_process_distributed, make_vllm_config

    ensure_single_process_distributed(make_vllm_config(config_dir("tiny-llama")))
    for has_features in (True, False):
        with fake_host(monkeypatch, has_features), vllm_patches.host_independent():
            layer = ReplicatedLinear(64, 32, bias=False, params_dtype=torch.bfloat16)
            layer.weight.data.normal_()
            before = layer.weight.detach().clone()
            layer.quant_method.process_weights_after_loading(layer)
        assert torch.equal(layer.weight, before)


# --- plans: byte-identical on an AMX host and on a host without AMX --------------------------------


def _compile(tmp_path, name, **options):
    from weightplan.compiler.compile import CompileOptions, compile_plan

    out = tmp_path / name
    compile_plan(CompileOptions(output=out, **options))
    return out


@needs_cpu_mla
@pytest.mark.parametrize("plan", ["hf-bf16-fsdp1__tp1__none", "stacked-bf16-fsdp64-ep8__tp1-dp32-ep__none"])
def test_glm_plans_compiled_on_an_amx_host_are_the_checked_in_plans(monkeypatch, tmp_path, plan):
    """The checked-in plans were compiled without AMX (and tests/e2e/test_glm_full.py recompiles them as the host is)."""
    import vllm

    from weightplan.runtime import load_plan

    traced = load_plan(REPO / "plans" / "glm-5.2" / f"{plan}.plan").header.vllm_version
    if vllm.__version__ != traced:
        pytest.skip(f"the checked-in plans were traced by vLLM {traced}; this is {vllm.__version__}")
    fmt, _, rest = plan.partition("-bf16-")
    trainer, inference, _ = rest.split("__")
    layouts = {"fsdp1": "fsdp=1", "fsdp64-ep8": "fsdp=64,ep=8", "tp1": "tp=1", "tp1-dp32-ep": "dp=32,ep"}
    with fake_host(monkeypatch, True):
        out = _compile(tmp_path, "amx.plan", model="glm-5.2", trainer_format=fmt, trainer=layouts[trainer],
                       inference=layouts[inference])
    assert out.read_bytes() == (REPO / "plans" / "glm-5.2" / f"{plan}.plan").read_bytes()


@needs_cpu_mla
def test_fp8_plans_and_their_verification_do_not_depend_on_the_host(monkeypatch, tmp_path):
    from weightplan.compiler.verify_plan import verify_plan
    from weightplan.runtime import load_plan

    options = dict(model=str(config_dir("fp8-deepseek-v3")), trainer_format="hf", trainer="fsdp=3", inference="tp=2",
                   quant="fp8_per_block")
    plans = {}
    for has_features in (True, False):
        with fake_host(monkeypatch, has_features):
            plans[has_features] = _compile(tmp_path, f"amx-{has_features}.plan", **options)
            result = verify_plan(plans[has_features], model=options["model"], seed=1)
            assert result.mismatches == ()
            assert result.tensors == sum(len(e.ranks) for e in load_plan(plans[has_features]).dests)
    assert plans[True].read_bytes() == plans[False].read_bytes()
    assert load_plan(plans[True]).header.inference.vllm_host == vllm_patches.HOST_PROFILE


# --- the trainer's transformers model is built outside every patch, and vLLM leaves transformers alone ----------


def _transformers_classes(model_type: str) -> dict[str, tuple]:
    """Bases and own attributes of every class in transformers' modeling module for `model_type`."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return {name: (cls.__bases__, dict(vars(cls))) for name, cls in inspect.getmembers(module, inspect.isclass)
            if cls.__module__ == module.__name__}


def test_a_patch_left_active_refuses_to_build_the_trainer_model():
    from weightplan.compiler.frontend.trainer_formats import load_trainer_model

    assert vllm_patches.active_targets() == ()
    with vllm_patches.host_independent():
        assert "torch.cpu:_is_amx_tile_supported" in vllm_patches.active_targets()
        with pytest.raises(RuntimeError, match=r"building the trainer's transformers model runs while vLLM is patched "
                                               r"\(torch\.cpu:_is_avx2_supported, "):
            load_trainer_model(config_dir("tiny-llama"), torch.bfloat16)
    assert vllm_patches.active_targets() == ()


def test_transformers_backed_models_verify_from_a_fresh_process(tmp_path):
    """vLLM serves HunYuan-V1 (like SeedOss, Starcoder2, OLMo) through its Transformers backend, which decorates
    transformers' own decoder class for torch.compile; a verify-plan process that builds vLLM's model first must
    still build the trainer's transformers model (issue 33), and compiling must leave transformers' classes as
    they were."""
    import subprocess
    import sys

    from weightplan.compiler.compile import CompileOptions, compile_plan
    from weightplan.compiler.frontend.trainer_formats import load_trainer_model

    model = str(config_dir("tiny-hunyuan-moe"))
    load_trainer_model(Path(model), torch.bfloat16)  # transformers caches class facts on its own first build
    before = _transformers_classes("hunyuan_v1_moe")
    plan = tmp_path / "hunyuan.plan"
    compile_plan(CompileOptions(model, output=plan))
    assert _transformers_classes("hunyuan_v1_moe") == before
    assert vllm_patches.active_targets() == ()
    verify = Path(sys.executable).parent / "verify-plan"
    done = subprocess.run([str(verify), str(plan), "--model", model], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "identical to vLLM" in done.stdout
