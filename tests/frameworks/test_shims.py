"""The framework code each weightplan adapter stands in for or reads behind is the code it was written against, by
source hash (`SHIMMED` of weightplan.adapters.trl and .verl): a release that edits it fails here; re-read it against
the adapter, then update SHIMMED."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect

import pytest

ADAPTERS = {"trl": ("weightplan.adapters.trl", "TESTED_TRL"), "verl": ("weightplan.adapters.verl", "TESTED_VERL")}


def _targets():
    for framework, (module, _) in ADAPTERS.items():
        if importlib.util.find_spec(framework) is None:
            continue
        for target in sorted(importlib.import_module(module).SHIMMED):
            yield pytest.param(framework, target, id=target)


@pytest.mark.parametrize("framework,target", list(_targets()))
def test_shimmed_framework_function_is_unchanged(framework, target):
    adapter = importlib.import_module(ADAPTERS[framework][0])
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    digest = hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()
    assert digest == adapter.SHIMMED[target], f"{target} changed in this {framework}; weightplan's adapter was read " \
                                              f"against {framework} {getattr(adapter, ADAPTERS[framework][1])}"
