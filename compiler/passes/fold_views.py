"""fold_views: rewrite each assignment's op chain into strided (source, destination) geometry pairs."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..ir import Assignment, Copy, Geometry, Node, Op, Program

# Chains whose value is not one strided view of one source (a reshape that torch could not
# express as a view, or a view of a cat) are folded by replaying them on index tensors; this
# bounds the elements such a chain may have.
MAX_REPLAY_ELEMENTS = 1 << 28


def fold_views(program: Program) -> Program:
    """Fold every assignment's chain into Copy nodes with strided geometry on both sides."""
    dest_numel = {spec.name: spec.numel for spec in program.dests}
    source_specs = {spec.name: spec for spec in program.sources}
    copies: list[Copy] = []
    for assignment in program.assignments:
        copies.extend(fold_assignment(assignment, source_specs, dest_numel[assignment.dest]))
    return dataclasses.replace(program, copies=tuple(copies))


def fold_assignment(assignment: Assignment, source_specs, dest_numel: int) -> list[Copy]:
    out: list[Copy] = []
    _push(assignment.node, assignment.geometry, (), assignment, source_specs, dest_numel, out)
    return out


def _push(node: Node, dst: Geometry, casts: tuple[str, ...], a: Assignment, specs, dest_numel, out) -> None:
    # Rule: casts and copies are elementwise, so they move to the copy's cast list.
    if node.op is Op.CAST:
        return _push(node.inputs[0], dst, (node.dtype,) + casts, a, specs, dest_numel, out)
    if node.op is Op.CONTIGUOUS:
        return _push(node.inputs[0], dst, casts, a, specs, dest_numel, out)
    # Rule: copy_(dst, cat(xs, d)) == copy_(dst.narrow(d, o_i, n_i), x_i) for each part.
    if node.op is Op.CAT:
        dim, start = node.args[0], 0
        for part in node.inputs:
            length = part.shape[dim]
            _push(part, narrow(dst, dim, start, length), casts, a, specs, dest_numel, out)
            start += length
        return
    folded = geometry_of(node)
    if folded is not None:
        source, geom, below = folded
        chain = _cast_chain(specs[source].dtype, below + casts)
        out.append(Copy(source, geom, a.dest, dst, chain))
        return
    out.extend(_replay(node, dst, casts, a, specs, dest_numel))


def _cast_chain(source_dtype: str, casts: tuple[str, ...]) -> tuple[str, ...]:
    """The dtype sequence a value passes through, starting at the source dtype, repeats collapsed."""
    chain = [source_dtype]
    for dtype in casts:
        if dtype != chain[-1]:
            chain.append(dtype)
    return tuple(chain)


def narrow(g: Geometry, dim: int, start: int, length: int) -> Geometry:
    shape = list(g.shape)
    shape[dim] = length
    return Geometry(g.offset + start * g.strides[dim], tuple(shape), g.strides)


def geometry_of(node: Node) -> tuple[str, Geometry, tuple[str, ...]] | None:
    """(source, strided geometry, casts below) if the chain is views/casts of one source, else None."""
    if node.op is Op.SOURCE:
        return node.args[0], Geometry.contiguous(node.shape), ()
    if node.op is Op.CAT:
        return None
    inner = geometry_of(node.inputs[0])
    if inner is None:
        return None
    source, g, casts = inner
    if node.op is Op.CAST:
        return source, g, casts + (node.dtype,)
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
    if np.prod(node.shape) > MAX_REPLAY_ELEMENTS:
        raise ValueError(
            f"loading {a.loading!r} into {a.dest!r}: chain {node.render()} is not a strided view and has "
            f"{np.prod(node.shape)} elements, more than the {MAX_REPLAY_ELEMENTS} the replay fold allows"
        )
    names = node.sources()
    bases, base = {}, 0
    for name in names:
        bases[name] = base
        base += specs[name].numel
    values = _evaluate(node, bases).reshape(-1).numpy()
    targets = torch.arange(dest_numel, dtype=torch.int64).as_strided(dst.shape, dst.strides, dst.offset)
    targets = targets.reshape(-1).numpy()
    starts = np.array([bases[n] for n in names], dtype=np.int64)
    which = np.searchsorted(starts, values, side="right") - 1
    breaks = np.flatnonzero((np.diff(values) != 1) | (np.diff(targets) != 1) | (np.diff(which) != 0)) + 1
    copies = []
    bounds = np.concatenate([[0], breaks, [len(values)]])
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        source = names[which[lo]]
        src = Geometry(int(values[lo] - bases[source]), (int(hi - lo),), (1,))
        out = Geometry(int(targets[lo]), (int(hi - lo),), (1,))
        chain = _cast_chain(specs[source].dtype, _casts_below(node, source) + casts)
        copies.append(Copy(source, src, a.dest, out, chain))
    return copies


def _casts_below(node: Node, source: str) -> tuple[str, ...]:
    """Casts applied on the path from `source` up to `node` (the first path that reaches it)."""
    if node.op is Op.SOURCE:
        return () if node.args[0] == source else None
    for child in node.inputs:
        below = _casts_below(child, source)
        if below is not None:
            return below + ((node.dtype,) if node.op is Op.CAST else ())
    return None


def _evaluate(node: Node, bases: dict[str, int]) -> torch.Tensor:
    """The chain's value on index tensors: element = global index of the source element it copies."""
    if node.op is Op.SOURCE:
        n = int(np.prod(node.shape))
        return (torch.arange(n, dtype=torch.int64) + bases[node.args[0]]).reshape(node.shape)
    values = [_evaluate(child, bases) for child in node.inputs]
    x = values[0]
    if node.op in (Op.CAST, Op.CONTIGUOUS):
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
        return x.permute(*node.args[0])
    if node.op is Op.RESHAPE:
        return x.reshape(node.args[0])
    if node.op is Op.EXPAND:
        return x.expand(node.args[0])
    raise AssertionError(f"unhandled op {node.op}")
