"""Group decoder layers that are identical up to their index, so each group is traced once.

Two layers are in one class when their trainer tensors and their vLLM parameters have the same
names (index removed), shapes and dtypes. Per class, the first and the last layer are traced
through vLLM's real loaders; the last one is the guard: the first layer's assignments, renamed,
must equal it exactly, or every layer of the class is traced for real. Other members reuse the
first layer's assignments with the layer index renamed (passes/expand_layers.py does it on runs).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from ..ir import Assignment, Node, Op, TensorEntry
from ..layer_names import LAYER, layer_of, rename

@dataclass(frozen=True)
class LayerClasses:
    """Layer index -> the template layer whose assignments it reuses (absent: traced for real)."""

    template_of: dict[int, int]
    guards: dict[int, int]  # guard layer -> template layer, both traced for real

    def traced(self, name: str) -> bool:
        index = layer_of(name)
        return index is None or index not in self.template_of


def _signature(specs: list[TensorEntry]) -> tuple:
    return tuple(sorted((LAYER.match(s.name)["tail"], s.shape, s.dtype) for s in specs))


def layer_classes(sources: list[TensorEntry], dests: list[TensorEntry]) -> LayerClasses:
    by_layer: dict[int, tuple[list, list]] = defaultdict(lambda: ([], []))
    for side, specs in ((0, sources), (1, dests)):
        for spec in specs:
            index = layer_of(spec.name)
            if index is not None:
                by_layer[index][side].append(spec)
    classes: dict[tuple, list[int]] = defaultdict(list)
    for index in sorted(by_layer):
        src, dst = by_layer[index]
        classes[(_signature(src), _signature(dst))].append(index)
    template_of, guards = {}, {}
    for members in classes.values():
        if len(members) < 3:
            continue
        template, guard = members[0], members[-1]
        guards[guard] = template
        for index in members[1:-1]:
            template_of[index] = template
    return LayerClasses(template_of, guards)


def rename_node(node: Node, old: int, new: int, memo: dict) -> Node:
    key = id(node)
    hit = memo.get(key)
    if hit is not None:
        return hit
    if node.op is Op.SOURCE:
        out = replace(node, args=(rename(node.args[0], old, new),))
    else:
        out = replace(node, inputs=tuple(rename_node(child, old, new, memo) for child in node.inputs))
    memo[key] = out
    return out


def rename_assignments(assignments: list[Assignment], old: int, new: int) -> list[Assignment]:
    memo: dict = {}
    return [
        Assignment(rename(a.dest, old, new), a.geometry, rename_node(a.node, old, new, memo), rename(a.loading, old, new))
        for a in assignments
    ]
