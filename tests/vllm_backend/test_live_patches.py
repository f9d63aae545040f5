"""The backend's live-engine inventory: every vLLM name and run-time attribute it relies on exists in the installed vLLM."""

from __future__ import annotations

import inspect
import types

import pytest

from weightplan.compiler.frontend.vllm_patches import exists, resolve
from weightplan.vllm_backend import live_patches
from weightplan.vllm_backend.live_patches import LIVE_CHANGES

from ..support.vllm_inventory import holds_on_installed_vllm


def code_names(function) -> set[str]:
    """Every global and attribute name a function's code (nested functions included) reads or sets."""
    stack, names = [inspect.unwrap(function).__code__], set()
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return names


def test_the_inventory_lists_what_the_backend_changes_inside_vllm():
    assert {c.name for c in LIVE_CHANGES} == {"Snapshot", "rebind_parameter", "first_load_post_process", "free_lora_slot",
                                              "route_lora_id_to_slot", "restore_lora_routes_after_reset"}


@pytest.mark.parametrize("change", LIVE_CHANGES, ids=[c.name for c in LIVE_CHANGES])
def test_every_live_target_and_attribute_exists_in_the_installed_vllm(change):
    import vllm
    from packaging.specifiers import SpecifierSet

    version = vllm.__version__
    assert SpecifierSet(live_patches.SUPPORTED_VLLM).contains(version, prereleases=True), (
        f"vLLM {version} is outside the backend's SUPPORTED_VLLM {live_patches.SUPPORTED_VLLM}")
    functions = change.targets + tuple(function for function, _ in change.attributes)

    def names_every_attribute() -> bool:
        return all(attribute in code_names(getattr(*resolve(function))) for function, attribute in change.attributes)

    if not holds_on_installed_vllm(change, functions, "vllm_backend/live_patches.py", names_every_attribute):
        return
    for function, attribute in change.attributes:
        assert attribute in code_names(getattr(*resolve(function))), (
            f"{change.name}: vLLM {version}'s {function} no longer names `{attribute}`; re-read vLLM and update "
            "vllm_backend/live_patches.py")


def test_the_installed_vllm_gets_one_snapshot_and_a_lora_reset_hook_only_where_it_resets():
    """vLLM 0.32's worker resets LoRA state after every update (the hook restores routes); 0.26's does not."""
    import vllm

    assert [c.name for c in LIVE_CHANGES if c.applies_to(vllm.__version__)].count("Snapshot") == 1
    assert live_patches.applies("restore_lora_routes_after_reset") == exists(
        "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.reset_lora_state")
    manager = types.SimpleNamespace(remove_all_adapters=lambda: None)
    live_patches.restore_lora_routes_after_reset(manager, lambda: None)
    hooked = manager.remove_all_adapters.__name__ == "remove_all_then_restore"
    assert hooked == live_patches.applies("restore_lora_routes_after_reset")


def test_code_names_sees_attributes_set_in_nested_functions():
    def outer(layer):
        def inner():
            layer.cpu_linear = None
        return inner

    assert {"cpu_linear"} <= code_names(outer) and "moe_kernel" not in code_names(outer)
