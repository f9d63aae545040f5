"""Our shard boxes equal what torch's DTensor holds, for random meshes, placements and shapes (fake process group)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from weightplan.runtime.layout.placements import Mesh, Placement, Sharding

from ..support.fake_world import as_rank, run_in_fresh_process


@st.composite
def layouts(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    world = math.prod(mesh_shape)
    ranks = tuple(draw(st.permutations(range(world))))
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=3)))
    kinds = ["replicate", "shard", "strided"] if shape else ["replicate"]
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(kinds))
        dim = draw(st.integers(0, len(shape) - 1)) if shape else 0
        placements.append(Placement(kind, dim, draw(st.integers(1, 3)) if kind == "strided" else 1))
    return Sharding(Mesh(mesh_shape, ranks), tuple(placements)), shape


def _torch_placement(p: Placement):
    if p.kind == "shard":
        return Shard(p.dim)
    if p.kind == "strided":
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return Replicate()


def test_boxes_equal_dtensor_local_shards():
    run_in_fresh_process(_check_boxes)


def _check_boxes():
    _boxes_equal_dtensor_local_shards()


def test_ranks_outside_the_mesh_hold_nothing():
    run_in_fresh_process(_ranks_outside_the_mesh_hold_nothing)


@settings(max_examples=150, deadline=None)
@given(layouts())
def _boxes_equal_dtensor_local_shards(case):
    sharding, shape = case
    world = len(sharding.mesh.ranks)
    full = torch.arange(max(math.prod(shape), 1), dtype=torch.int64)[: math.prod(shape)].reshape(shape)
    placements = [_torch_placement(p) for p in sharding.placements]
    try:
        boxes = {rank: sharding.box(shape, rank) for rank in range(world)}
    except ValueError as exc:
        assert "non-contiguous" in str(exc)
        boxes = None
    not_boxes = 0
    for rank in range(world):
        as_rank(rank, world)
        mesh = DeviceMesh("cpu", torch.tensor(sharding.mesh.ranks).reshape(sharding.mesh.shape))
        local = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
        assert tuple(local.shape) == tuple(local_shape)
        view = full
        for d, (start, size) in enumerate(zip(offset, local_shape)):
            view = view.narrow(d, min(start, shape[d]), size)
        if boxes is None:
            not_boxes += not torch.equal(view, local)
            continue
        box = boxes[rank]
        assert tuple(b - a for a, b in box) == tuple(local_shape)
        if all(b > a for a, b in box):
            assert tuple(a for a, _ in box) == tuple(offset)
        else:  # an empty shard: DTensor reports the dim's size as the offset of its empty dims
            assert all(a == (n if b == a else o) for (a, b), n, o in zip(box, shape, offset))
        assert torch.equal(view, local)
    if boxes is None:
        assert not_boxes > 0, "we refused a layout whose shards DTensor holds as boxes"


def _ranks_outside_the_mesh_hold_nothing():
    sharding = Sharding(Mesh((2,), (1, 3)), (Placement("shard", 0),))
    assert sharding.box((4, 2), 0) is None and sharding.box((4, 2), 3) == ((2, 4), (0, 2))
    as_rank(0, 4)
    mesh = DeviceMesh("cpu", torch.tensor([1, 3]))
    assert compute_local_shape_and_global_offset((4, 2), mesh, [Shard(0)]) == ((0,), ())
