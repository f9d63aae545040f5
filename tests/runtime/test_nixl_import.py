"""Which NIXL build the runtime imports: the one matching torch's CUDA major, else whichever imports."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from weightplan.runtime.errors import WeightplanError
from weightplan.runtime.transport.nixl_agent import _nixl


def _missing(monkeypatch, name: str) -> None:
    """`name` not installed, whether or not an earlier test imported it (its `_api` may be in sys.modules)."""
    for module in (name, f"{name}._api"):
        monkeypatch.setitem(sys.modules, module, None)


def _fake_build(monkeypatch, name: str) -> type:
    api = types.ModuleType(f"{name}._api")
    api.nixl_agent = type(f"{name}_agent", (), {})
    api.nixl_agent_config = type(f"{name}_config", (), {})
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, f"{name}._api", api)
    return api.nixl_agent


@pytest.mark.parametrize("cuda, expected", [("13.0", "nixl_cu13"), ("12.8", "nixl_cu12"), (None, "nixl_cu12")])
def test_the_build_of_torchs_cuda_major_is_taken_when_both_are_installed(monkeypatch, cuda, expected):
    agents = {name: _fake_build(monkeypatch, name) for name in ("nixl_cu12", "nixl_cu13")}
    monkeypatch.setattr(torch.version, "cuda", cuda)
    assert _nixl()[0] is agents[expected]


def test_the_other_build_serves_when_the_matching_one_is_missing(monkeypatch):
    agent = _fake_build(monkeypatch, "nixl_cu12")
    _missing(monkeypatch, "nixl_cu13")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert _nixl()[0] is agent


def test_no_build_at_all_is_one_error_naming_the_package(monkeypatch):
    for name in ("nixl_cu12", "nixl_cu13"):
        _missing(monkeypatch, name)
    with pytest.raises(WeightplanError, match="NIXL is not installed.*`nixl` package"):
        _nixl()
