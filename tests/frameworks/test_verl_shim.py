"""weightplan.adapters.verl finds the actor's shards behind verl's FSDP2 full-tensor generator without starting it (the
hash of that verl function: test_shims.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")
verl_adapter = pytest.importorskip("weightplan.adapters.verl")


def _find_shards_behind_a_generator() -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from tests.support.fake_world import as_rank

    as_rank(0, 2)
    mesh = init_device_mesh("cpu", (2,))
    params = {"w": distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]), "b": torch.zeros(2)}
    started = []

    def full_tensors():
        started.append(True)
        for name, param in params.items():
            yield name, param.full_tensor() if isinstance(param, DTensor) else param

    generator = (pair for pair in full_tensors())
    assert verl_adapter.actor_shards(generator) is params
    assert started == []
    try:
        verl_adapter.actor_shards(pair for pair in [("w", torch.ones(1))])
    except TypeError as exc:
        assert "cannot find them behind generator" in str(exc), exc
    else:
        raise AssertionError("a generator over plain tensors was taken for the actor's shards")


def test_the_shards_are_found_behind_an_unstarted_generator_of_full_tensors():
    """actor_shards finds the DTensor state dict a verl-shaped generator iterates, and never starts the generator (in a
    process of its own: a fake process group here would pull the one vLLM's model-parallel state holds from under it)."""
    from ..support.fake_world import run_in_fresh_process

    run_in_fresh_process(_find_shards_behind_a_generator)
