"""expand_layers: give every reused decoder layer its template layer's runs and constants, tensors renamed by layer index."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np

from ..ir import Constants, Program, Runs
from ..layer_names import layer_tail


def expand_layers(program: Program) -> Program:
    """Append, for each `LayerReuse(template, member)` in order, the template layer's runs and
    constants (those writing a destination of the template layer) with every tensor of the
    template layer replaced by the member layer's tensor of the same name past the index.

    This is what renaming the template's assignments and folding and lowering them again gives
    (layer_classes only reuses layers whose tensors match by name, shape and dtype), at the cost
    of an index remap: the traced chains of a layer class are folded and lowered once.
    """
    if not program.layer_reuse:
        return program
    src_of, dst_of = _by_layer(program.sources), _by_layer(program.dests)
    dst_layer = np.full(len(program.dests), -1, dtype=np.int64)
    for layer, names in dst_of.items():
        dst_layer[list(names.values())] = layer
    runs, constants = program.runs, program.constants
    run_parts, constant_parts = [runs], [constants]
    last_writes = dict(program.last_writes)
    for reuse in program.layer_reuse:
        src_map = _renaming(len(program.sources), src_of, reuse.template, reuse.member)
        dst_map = _renaming(len(program.dests), dst_of, reuse.template, reuse.member)
        mine = runs.take(np.flatnonzero(dst_layer[runs.dest] == reuse.template))
        run_parts.append(dataclasses.replace(mine, src=src_map[mine.src], dest=dst_map[mine.dest]))
        own = constants.take(np.flatnonzero(dst_layer[constants.dest] == reuse.template))
        constant_parts.append(dataclasses.replace(own, dest=dst_map[own.dest]))
        for tail, d in dst_of[reuse.template].items():
            if program.dests[d].name in program.last_writes:
                last_writes[program.dests[dst_of[reuse.member][tail]].name] = program.last_writes[program.dests[d].name]
    return dataclasses.replace(program, runs=Runs.concat(run_parts), constants=Constants.concat(constant_parts),
                               last_writes=last_writes, layer_reuse=())


def _by_layer(specs) -> dict[int, dict[tuple[str, str], int]]:
    """Layer index -> (name before the index, name past it) -> table index, for the tensors of decoder layers."""
    out: dict[int, dict[tuple[str, str], int]] = defaultdict(dict)
    for i, spec in enumerate(specs):
        parsed = layer_tail(spec.name)
        if parsed is not None:
            layer, key = parsed
            out[layer][key] = i
    return out


def _renaming(n: int, by_layer: dict, template: int, member: int) -> np.ndarray:
    """Table index -> index after renaming layer `template`'s tensors to layer `member`'s (others unchanged)."""
    mapping = np.arange(n, dtype=np.int64)
    target = by_layer.get(member, {})
    for key, i in by_layer.get(template, {}).items():
        mapping[i] = target[key]  # layer_classes grouped these layers by equal names past the index
    return mapping

