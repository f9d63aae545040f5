"""The vLLM backend's reading of an EPLB engine's table (vllm_backend/eplb.py) through vLLM's own wiring: a Qwen3-MoE
model vLLM's CUDA build makes with --enable-eplb (traced, no GPU), its EPLB maps registered by vLLM's
`set_eplb_state` and rearranged by vLLM's `_commit_eplb_maps`, as its balancer commits them in a live engine."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from weightplan.runtime import PlanMismatchError
from weightplan.runtime.plan.header import EplbHeader

from ..conftest import config_dir

LOGICAL, REDUNDANT, RANKS, MAX_REPLICAS = 8, 2, 2, 1024  # vLLM sizes the map for 1023 redundant copies


@pytest.fixture(scope="module")
def model():
    from weightplan.compiler.frontend.vllm_model import build_model, make_vllm_config

    path = config_dir("tiny-qwen3-moe")
    config = make_vllm_config(path, dp=RANKS, ep=True, eplb=REDUNDANT)
    return build_model(config, "meta", dp_rank=1, base_config=make_vllm_config(path))


def _vllm_state(model, table: torch.Tensor):
    """vLLM's per-model EPLB tensors for `table` (EplbState.add_model's shapes), registered with the model."""
    from vllm.distributed.eplb.eplb_state import compute_logical_maps

    layers, physical = table.shape
    to_physical, replicas = compute_logical_maps(table, LOGICAL)
    state = SimpleNamespace(
        physical_to_logical_map=table.clone(), physical_to_logical_map_buffer=table.clone(),
        logical_to_physical_map=torch.nn.functional.pad(to_physical, (0, MAX_REPLICAS - to_physical.shape[-1]), value=-1),
        logical_replica_count=replicas.clone())
    model.set_eplb_state(torch.zeros(layers, physical, dtype=torch.int32), state.logical_to_physical_map,
                         state.logical_replica_count)
    return state


def test_the_backend_reads_the_table_vllm_commits(model, monkeypatch):
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

    from weightplan.vllm_backend.eplb import engine_expert_map

    monkeypatch.setattr(eplb_state, "PIN_MEMORY", False)  # no GPU to pin host memory for
    layers = len(model.moe_layers)
    eplb = EplbHeader(LOGICAL, REDUNDANT, tuple((f"layer{i}",) for i in range(layers)))
    initial = torch.tensor(EplbState.build_initial_global_physical_to_logical_map(LOGICAL, REDUNDANT)).repeat(layers, 1)
    state = _vllm_state(model, initial)
    assert np.array_equal(engine_expert_map(model, eplb), initial.numpy())
    load = torch.rand(layers, LOGICAL, generator=torch.Generator().manual_seed(3)) * 100
    moved = DefaultEplbPolicy.rebalance_experts(load, LOGICAL + REDUNDANT, 1, 1, RANKS)
    assert not torch.equal(moved, initial)
    eplb_state._commit_eplb_maps(state, moved)  # in place, into the tensors the layers hold views of
    assert np.array_equal(engine_expert_map(model, eplb), moved.numpy())


def test_a_plan_with_other_layers_or_an_engine_without_eplb_state_is_refused(model):
    from weightplan.vllm_backend.eplb import engine_expert_map

    with pytest.raises(PlanMismatchError, match=r"the engine's model lists 4 MoE layers \(`moe_layers`\); the EPLB plan "
                                                r"has 3"):
        engine_expert_map(model, EplbHeader(LOGICAL, REDUNDANT, (("a",), ("b",), ("c",))))
    with pytest.raises(PlanMismatchError, match=r"has no EPLB state: start the engine with --enable-eplb"):
        engine_expert_map(SimpleNamespace(moe_layers=[torch.nn.Linear(1, 1)]), EplbHeader(LOGICAL, REDUNDANT, (("a",),)))


def test_a_worker_makes_a_new_receiver_only_after_vllm_moved_experts(model, monkeypatch):
    """The backend's Side (vllm_backend/engine.py) on vLLM's wiring: no new Receiver while the table holds, one on the
    committed table after a rearrangement, the old one closed first."""
    from vllm.distributed.eplb import eplb_state
    from vllm.distributed.eplb.eplb_state import EplbState

    from weightplan.vllm_backend.engine import Side

    monkeypatch.setattr(eplb_state, "PIN_MEMORY", False)
    layers = len(model.moe_layers)
    eplb = EplbHeader(LOGICAL, REDUNDANT, tuple((f"layer{i}",) for i in range(layers)))
    initial = torch.tensor(EplbState.build_initial_global_physical_to_logical_map(LOGICAL, REDUNDANT)).repeat(layers, 1)
    state = _vllm_state(model, initial)
    events = []

    class Receiver(SimpleNamespace):
        def close(self):
            events.append(("closed", self.expert_map))

    def make_receiver(table):
        events.append(("made", table))
        return Receiver(expert_map=table)

    plan = SimpleNamespace(header=SimpleNamespace(inference=SimpleNamespace(eplb=eplb)))
    side = Side(model, plan, Receiver(expert_map=initial.numpy()), None, None, (), make_receiver)
    assert side.moved_experts() is None and events == []
    moved = initial.flip(1).contiguous()  # every slot of every layer holds another expert now
    eplb_state._commit_eplb_maps(state, moved)
    table = side.moved_experts()
    assert np.array_equal(table, moved.numpy())
    side.follow_experts(table)
    assert [what for what, _ in events] == ["closed", "made"] and np.array_equal(side.receiver.expert_map, moved.numpy())
    assert side.moved_experts() is None
