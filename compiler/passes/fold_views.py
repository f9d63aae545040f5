"""fold_views: rewrite each assignment's op chain into strided (source, destination) geometry pairs."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from weightplan.runtime.casts import is_elementwise
from weightplan.runtime.errors import WeightplanError
from ..ir import Assignment, Copy, Fill, Geometry, Node, Op, Program

# Chains whose value is not one strided view of one source (a reshape that torch could not
# express as a view, or a view of a cat) are folded by replaying them on index tensors; this
# bounds the elements such a chain may have.
MAX_REPLAY_ELEMENTS = 1 << 28


class FoldError(WeightplanError):
    """A traced chain that is not a strided view is too large to fold by replaying it."""


def fold_views(program: Program) -> Program:
    """Fold every assignment's chain into Copy nodes with strided geometry on both sides; constants become Fills."""
    dest_numel = {spec.name: spec.numel for spec in program.dests}
    source_specs = {spec.name: spec for spec in program.sources}
    copies: list[Copy] = []
    fills: list[Fill] = []
    last: dict[str, Assignment] = {}
    memo: dict[int, tuple] = {}
    for order, assignment in enumerate(program.assignments):
        last[assignment.dest] = assignment
        if assignment.node.op is Op.CONSTANT:
            fills.append(Fill(assignment.dest, assignment.geometry, assignment.node.args[0], order, assignment.loading))
            continue
        copies.extend(fold_assignment(assignment, source_specs, dest_numel[assignment.dest], memo))
    last_writes = {dest: describe_write(a) for dest, a in last.items()}
    return dataclasses.replace(program, copies=tuple(copies), fills=tuple(fills), last_writes=last_writes)


def describe_write(a: Assignment, limit: int = 160) -> str:
    """One assignment for messages: its op and value, the region it wrote and the checkpoint tensor being loaded."""
    g = a.geometry
    if a.node.op is Op.CONSTANT:
        what = f"{a.node.args[1]}({a.node.args[0]})"
    else:
        rendered = a.node.render()
        what = "copy_ of " + (rendered if len(rendered) <= limit else rendered[: limit - 3] + "...")
    return f"{what} into elements at offset {g.offset} shape {list(g.shape)} strides {list(g.strides)}, loading {a.loading!r}"


def fold_assignment(assignment: Assignment, source_specs, dest_numel: int, memo: dict | None = None) -> list[Copy]:
    out: list[Copy] = []
    _push(assignment.node, assignment.geometry, (), assignment, source_specs, dest_numel, out, {} if memo is None else memo)
    return out


def _push(node: Node, dst: Geometry, casts: tuple[str, ...], a: Assignment, specs, dest_numel, out, memo) -> None:
    # Rule: casts, elementwise steps and copies commute with views, so they move to the copy's cast chain.
    if node.op in _STEPS:
        return _push(node.inputs[0], dst, (_step(node),) + casts, a, specs, dest_numel, out, memo)
    if node.op is Op.CONTIGUOUS:
        return _push(node.inputs[0], dst, casts, a, specs, dest_numel, out, memo)
    # Rule: copy_(dst, cat(xs, d)) == copy_(dst.narrow(d, o_i, n_i), x_i) for each part.
    if node.op is Op.CAT:
        dim, start = node.args[0], 0
        for part in node.inputs:
            length = part.shape[dim]
            _push(part, narrow(dst, dim, start, length), casts, a, specs, dest_numel, out, memo)
            start += length
        return
    folded = geometry_of(node, memo)
    if folded is not None:
        source, geom, below = folded
        chain = _cast_chain(specs[source].dtype, below + casts)
        out.append(Copy(source, geom, a.dest, dst, chain))
        return
    out.extend(_replay(node, dst, casts, a, specs, dest_numel))


_STEPS = (Op.CAST, Op.MAP)


def _step(node: Node) -> str:
    """A CAST's dtype or a MAP's elementwise step name: one entry of a cast chain."""
    return node.dtype if node.op is Op.CAST else node.args[0]


def _cast_chain(source_dtype: str, steps: tuple[str, ...]) -> tuple[str, ...]:
    """The dtypes and elementwise steps a value passes through, from the source dtype to the wire dtype.

    Repeated dtypes collapse (a cast to the current dtype is no step); elementwise steps never do;
    the chain ends with the dtype the last step left the value in.
    """
    chain, current = [source_dtype], source_dtype
    for step in steps:
        if is_elementwise(step):
            chain.append(step)
        elif step != current:
            chain.append(step)
            current = step
    if is_elementwise(chain[-1]):
        chain.append(current)
    return tuple(chain)


def narrow(g: Geometry, dim: int, start: int, length: int) -> Geometry:
    shape = list(g.shape)
    shape[dim] = length
    return Geometry(g.offset + start * g.strides[dim], tuple(shape), g.strides)


def geometry_of(node: Node, memo: dict | None = None) -> tuple[str, Geometry, tuple[str, ...]] | None:
    """(source, strided geometry, casts below) if the chain is views/casts of one source, else None.

    Nodes are shared between assignments (one stacked expert tensor feeds every expert's copies),
    so `memo` folds each node once; it is keyed by id and keeps the node alive so ids stay unique.
    """
    if memo is None:
        memo = {}
    hit = memo.get(id(node))
    if hit is not None:
        return hit[1]
    result = _geometry_of(node, memo)
    memo[id(node)] = (node, result)
    return result


def _geometry_of(node: Node, memo: dict) -> tuple[str, Geometry, tuple[str, ...]] | None:
    if node.op is Op.SOURCE:
        return node.args[0], Geometry.contiguous(node.shape), ()
    if node.op is Op.CAT:
        return None
    inner = geometry_of(node.inputs[0], memo)
    if inner is None:
        return None
    source, g, casts = inner
    if node.op in _STEPS:
        return source, g, casts + (_step(node),)
    if node.op is Op.CONTIGUOUS:
        return source, g, casts
    folded = _VIEW_RULES[node.op](g, *node.args)
    return None if folded is None else (source, folded, casts)


def _slice(g: Geometry, dim: int, start: int, length: int, step: int) -> Geometry:
    # Rule: slice moves the offset by start*stride and multiplies the stride by step.
    shape, strides = list(g.shape), list(g.strides)
    shape[dim], strides[dim] = length, strides[dim] * step
    return Geometry(g.offset + start * g.strides[dim], tuple(shape), tuple(strides))


def _select(g: Geometry, dim: int, index: int) -> Geometry:
    # Rule: select moves the offset by index*stride and drops the dim.
    shape, strides = list(g.shape), list(g.strides)
    del shape[dim], strides[dim]
    return Geometry(g.offset + index * g.strides[dim], tuple(shape), tuple(strides))


def _permute(g: Geometry, dims: tuple[int, ...]) -> Geometry:
    # Rule: permute reorders shape and strides together.
    return Geometry(g.offset, tuple(g.shape[d] for d in dims), tuple(g.strides[d] for d in dims))


def _expand(g: Geometry, shape: tuple[int, ...]) -> Geometry:
    # Rule: expand gives new and broadcast (size-1) dims a zero stride.
    lead = len(shape) - len(g.shape)
    strides = [0] * lead + [0 if size == 1 and want != 1 else stride for size, stride, want in zip(g.shape, g.strides, shape[lead:])]
    return Geometry(g.offset, tuple(shape), tuple(strides))


def _reshape(g: Geometry, shape: tuple[int, ...]) -> Geometry | None:
    # Rule: reshape folds iff torch could express it as a view of these strides.
    try:
        probe = torch.empty_strided(g.shape, g.strides, device="meta").view(shape)
    except RuntimeError:
        return None
    return Geometry(g.offset, tuple(probe.shape), tuple(probe.stride()))


_VIEW_RULES = {Op.SLICE: _slice, Op.SELECT: _select, Op.PERMUTE: _permute, Op.EXPAND: _expand, Op.RESHAPE: _reshape}


def _replay(node: Node, dst: Geometry, casts, a: Assignment, specs, dest_numel: int) -> list[Copy]:
    """Fold a non-strided chain exactly: replay it on index tensors, emit one 1-D copy per run."""
    numel = int(np.prod(node.shape))
    if numel > MAX_REPLAY_ELEMENTS:
        raise FoldError(
            f"loading {a.loading!r} into {a.dest!r}: chain {node.render()} is not a strided view and has "
            f"{numel} elements, more than the {MAX_REPLAY_ELEMENTS} the replay fold allows"
        )
    if numel == 0:
        return []
    names = node.sources()
    bases, base = {}, 0
    for name in names:
        bases[name] = base
        base += specs[name].numel
    paths: list[tuple[str, ...]] = [()]  # cast sequences seen so far; elements carry an index into it
    pairs = _evaluate(node, bases, paths).reshape(-1, 2).numpy()
    values, path = pairs[:, 0], pairs[:, 1]
    targets = torch.arange(dest_numel, dtype=torch.int64).as_strided(dst.shape, dst.strides, dst.offset)
    targets = targets.reshape(-1).numpy()
    starts = np.array([bases[n] for n in names], dtype=np.int64)
    which = np.searchsorted(starts, values, side="right") - 1
    breaks = np.diff(values) != 1
    breaks |= (np.diff(targets) != 1) | (np.diff(which) != 0) | (np.diff(path) != 0)
    bounds = np.concatenate([[0], np.flatnonzero(breaks) + 1, [len(values)]])
    copies = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        source = names[which[lo]]
        src = Geometry(int(values[lo] - bases[source]), (int(hi - lo),), (1,))
        out = Geometry(int(targets[lo]), (int(hi - lo),), (1,))
        chain = _cast_chain(specs[source].dtype, paths[path[lo]] + casts)
        copies.append(Copy(source, src, a.dest, out, chain))
    return copies


def _evaluate(node: Node, bases: dict[str, int], paths: list) -> torch.Tensor:
    """The chain's value on index tensors, shape node.shape + (2,).

    [..., 0] is the global index of the source element each element copies; [..., 1] indexes
    `paths`, the casts applied on the way from that source (paths may differ per element).
    """
    nd = len(node.shape)
    if node.op is Op.SOURCE:
        index = torch.arange(int(np.prod(node.shape)), dtype=torch.int64) + bases[node.args[0]]
        return torch.stack([index, torch.zeros_like(index)], dim=-1).reshape(node.shape + (2,))
    values = [_evaluate(child, bases, paths) for child in node.inputs]
    x = values[0]
    if node.op is Op.CONTIGUOUS:
        return x
    if node.op in _STEPS:
        x = x.clone()
        extended = []
        for old in range(len(paths)):
            chain = paths[old] + (_step(node),)
            if chain not in paths:
                paths.append(chain)
            extended.append(paths.index(chain))
        x[..., 1] = torch.tensor(extended, dtype=torch.int64)[x[..., 1]]
        return x
    if node.op is Op.CAT:
        return torch.cat(values, dim=node.args[0])
    if node.op is Op.SLICE:
        dim, start, length, step = node.args
        return x.narrow(dim, start, (length - 1) * step + 1 if length else 0)[
            (slice(None),) * dim + (slice(None, None, step),)
        ]
    if node.op is Op.SELECT:
        return x.select(*node.args)
    if node.op is Op.PERMUTE:
        return x.permute(*node.args[0], nd)
    if node.op is Op.RESHAPE:
        return x.reshape(tuple(node.args[0]) + (2,))
    if node.op is Op.EXPAND:
        return x.expand(tuple(node.args[0]) + (2,))
    raise AssertionError(f"unhandled op {node.op}")
