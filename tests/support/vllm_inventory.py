"""The check both vLLM inventories' tests make (compile-time patches, the backend's live changes) on the installed vLLM."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest

from weightplan.compiler.frontend.vllm_patches import exists, resolve


def holds_on_installed_vllm(change, targets: Iterable[str], inventory: str,
                            touches_all: Callable[[], bool] | None = None) -> bool:
    """Whether `change` (a VllmPatch or a LiveChange) applies to the installed vLLM, checked against what it touches.

    Applying: every target resolves, else the test fails naming the target and `inventory` (the file to update). Not
    applying (an alternative for other vLLMs): something it touches must be missing here, else its declared versions
    leave out this vLLM; `touches_all` (only called when every target exists) says whether the rest it touches is too.
    """
    import vllm

    version, targets = vllm.__version__, tuple(targets)
    if not change.applies_to(version):
        assert not (all(map(exists, targets)) and (touches_all is None or touches_all())), (
            f"{change.name} declares vLLM {change.vllm_versions}, but the installed {version} has all it touches: "
            "widen its vllm_versions")
        return False
    for target in targets:
        try:
            resolve(target)
        except (ImportError, AttributeError) as exc:
            pytest.fail(f"{change.name}: vLLM {version} has no {target} ({exc}); it declares vLLM "
                        f"{change.vllm_versions}: re-read vLLM and update {inventory}")
    return True
