"""The pipeline stages of a trainer layout with `pp`: which stage holds each tensor, checked against torchtitan's shape.

Stage `s` of a layout with `pp = P` over `W` trainer ranks is ranks `s * W / P .. (s + 1) * W / P - 1`
(torchtitan's mesh puts `pp` outermost; the plan header's `trainer.pp` numbers stages the same way).
Every tensor lives on one stage, except a tied embedding, on the first and the last stage as a
`Replicate()` over a leading mesh dim with one slice per stage. A stage holds a contiguous range of
layers (names with `layers.<i>.`, global indices), the stages in order, with no layer missing between them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import LayoutError
from .placements import Sharding

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The global layer index of a trainer tensor named `...layers.<i>....` (None outside the layers)."""
    match = _LAYER.search(name)
    return int(match[1]) if match else None


def stages_of(sharding: Sharding, per_stage: int) -> list[int]:
    """The stages whose ranks hold part of a tensor with this sharding."""
    return sorted({rank // per_stage for rank in sharding.mesh.ranks})


def check_stages(shardings: Mapping[str, Sharding], world: int, pp: int, where: str) -> None:
    """Refuse (LayoutError, one line after `where`) a `pp` that does not split this layout into torchtitan-style stages."""
    if world % pp:
        raise LayoutError(f"{where}: pp {pp} does not divide world_size {world}; stage s is the trainer ranks "
                          f"s * world_size / pp onwards (torchtitan puts pp outermost)")
    per_stage, last = world // pp, pp - 1
    layers: dict[int, set[int]] = {}
    for name, sharding in shardings.items():
        stages = stages_of(sharding, per_stage)
        layer = layer_of(name)
        if len(stages) > 1 and not _tied_replica(sharding, per_stage, stages, last, layer):
            raise LayoutError(f"{where}: tensor {name!r} is on pipeline stages {stages}; a tensor lives on one stage (only a "
                              "tied embedding is on the first and the last, as Replicate() over a leading mesh dim of one "
                              "slice per stage)")
        if layer is not None:
            layers.setdefault(layer, set()).update(stages)
    split = [layer for layer, held in layers.items() if len(held) > 1]
    if split:
        raise LayoutError(f"{where}: layer {min(split)} has tensors on stages {sorted(layers[min(split)])}; each layer "
                          "lives on one pipeline stage")
    ranges = {}
    for layer, (stage,) in sorted(layers.items()):
        first, _ = ranges.get(stage, (layer, layer))
        ranges[stage] = (first, layer)
    if layers and (gap := next((i for i in range(max(layers)) if i not in layers), None)) is not None:
        raise LayoutError(f"{where}: no pipeline stage holds layer {gap} ({_ranges_text(ranges)}); every layer up to "
                          f"{max(layers)} must be on one stage")
    order = sorted(ranges)
    for earlier, later in zip(order, order[1:]):
        if ranges[earlier][1] > ranges[later][0]:
            raise LayoutError(f"{where}: stage {earlier} holds layers past stage {later}'s ({_ranges_text(ranges)}); "
                              "stages hold contiguous layer ranges in stage order")


def _tied_replica(sharding: Sharding, per_stage: int, stages: list[int], last: int, layer: int | None) -> bool:
    """A tied embedding's layout: on the first and the last stage, Replicate() over a leading mesh dim of one slice each."""
    mesh = sharding.mesh
    if layer is not None or stages != [0, last] or len(mesh.shape) < 2 or mesh.shape[0] != 2:
        return False
    if sharding.placements[0].kind != "replicate":
        return False
    size = len(mesh.ranks) // 2
    return [{r // per_stage for r in mesh.ranks[i * size:(i + 1) * size]} for i in (0, 1)] == [{0}, {last}]


def _ranges_text(ranges: dict[int, tuple[int, int]]) -> str:
    return ", ".join(f"stage {s}: layers {a}..{b}" for s, (a, b) in sorted(ranges.items()))
