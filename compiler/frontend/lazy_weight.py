"""LazyWeight: a storage-less tensor whose aten ops are recorded as IR nodes instead of run."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightplan.runtime.casts import scale_step
from weightplan.runtime.plan.schema import dtype_name
from ..ir import Assignment, Geometry, Node, Op
from .errors import ConstantWriteError, DataDependentError, DestinationError, UnsupportedOpError

aten = torch.ops.aten


class LazyWeight(torch.Tensor):
    """A proxy for a trainer/checkpoint tensor: metadata only, plus the IR node producing it.

    Shapes and strides come from a `shadow` meta tensor on which every op is replayed, so shape
    inference and argument checking are torch's own.
    """

    node: Node
    shadow: torch.Tensor

    @staticmethod
    def __new__(cls, node: Node, shadow: torch.Tensor):
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            shadow.shape,
            strides=shadow.stride(),
            storage_offset=shadow.storage_offset(),
            dtype=shadow.dtype,
            device=shadow.device,
            requires_grad=False,
        )
        out.node = node
        out.shadow = shadow
        return out

    @classmethod
    def source(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> "LazyWeight":
        shadow = torch.empty(shape, dtype=dtype, device="meta")
        return cls(Node(Op.SOURCE, (name,), (), tuple(shape), dtype_name(dtype)), shadow)

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        return f"LazyWeight({self.node.render()}, shape={tuple(self.shape)}, dtype={self.dtype})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    def data_ptr(self):  # noqa: D102
        raise DataDependentError("data_ptr()", _current().loading)

    def untyped_storage(self):  # noqa: D102
        raise DataDependentError("untyped_storage()", _current().loading)

    def tolist(self):  # noqa: D102
        raise DataDependentError("tolist()", _current().loading)

    def numpy(self, *args, **kwargs):  # noqa: D102
        raise DataDependentError("numpy()", _current().loading)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = _current()
        handler = _HANDLERS.get(func)
        if handler is None:
            if func in _DATA_DEPENDENT:
                raise DataDependentError(str(func), tracer.loading)
            raise UnsupportedOpError(str(func), _arg_types(args, kwargs), tracer.loading)
        return handler(tracer, func, args, kwargs)


def _arg_types(args, kwargs) -> str:
    def describe(a):
        if isinstance(a, LazyWeight):
            return f"LazyWeight[{a.dtype},{tuple(a.shape)}]"
        if isinstance(a, torch.Tensor):
            return f"Tensor[{a.device},{a.dtype},{tuple(a.shape)}]"
        return type(a).__name__

    flat = [describe(a) for a in args] + [f"{k}={describe(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(flat) + ")"


def _shadow(x):
    if isinstance(x, LazyWeight):
        return x.shadow
    if isinstance(x, (list, tuple)):  # cat's tensor list; shape lists pass through unchanged
        return type(x)(_shadow(v) for v in x)
    return x


def _run_shadow(func, args, kwargs):
    # A hand-rolled unwrap: torch's tree_map costs more than the meta op itself on this hot path.
    return func(*[_shadow(a) for a in args], **{k: _shadow(v) for k, v in kwargs.items()})


def _wrap(op: Op, op_args: tuple, inputs: tuple[Node, ...], shadow: torch.Tensor) -> LazyWeight:
    node = Node(op, op_args, inputs, tuple(shadow.shape), dtype_name(shadow.dtype))
    return LazyWeight(node, shadow)


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


# --- handlers: each turns one aten op into canonical IR ops (see ir.Op) -------------------


def _slice(tracer, func, args, kwargs):
    x = args[0]
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
    start = args[2] if len(args) > 2 else kwargs.get("start")
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    out = _run_shadow(func, args, kwargs)
    size = x.shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    start = min(max(start, 0), size)
    return _wrap(Op.SLICE, (dim, start, out.shape[dim], step), (x.node,), out)


def _select(tracer, func, args, kwargs):
    x, dim, index = args[0], args[1], args[2]
    dim = _norm_dim(dim, x.dim())
    index = index + x.shape[dim] if index < 0 else index
    return _wrap(Op.SELECT, (dim, index), (x.node,), _run_shadow(func, args, kwargs))


def _pieces(tracer, func, args, kwargs):
    """split / split_with_sizes / unbind: one SLICE or SELECT node per output."""
    x = args[0]
    outs = _run_shadow(func, args, kwargs)
    if func is aten.unbind.int:
        dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), x.dim())
        return [_wrap(Op.SELECT, (dim, i), (x.node,), o) for i, o in enumerate(outs)]
    dim = _norm_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), x.dim())
    result, begin = [], 0
    for o in outs:
        result.append(_wrap(Op.SLICE, (dim, begin, o.shape[dim], 1), (x.node,), o))
        begin += o.shape[dim]
    return result


def _permute(tracer, func, args, kwargs):
    x = args[0]
    out = _run_shadow(func, args, kwargs)
    nd = x.dim()
    if func is aten.permute.default:
        dims = tuple(_norm_dim(d, nd) for d in args[1])
    else:
        if func is aten.t.default:
            if nd < 2:  # t() of a 0-d or 1-d tensor is the tensor itself
                return LazyWeight(x.node, out)
            d0, d1 = 0, 1
        else:
            d0, d1 = _norm_dim(args[1], nd), _norm_dim(args[2], nd)
        order = list(range(nd))
        order[d0], order[d1] = order[d1], order[d0]
        dims = tuple(order)
    if dims == tuple(range(nd)):
        return LazyWeight(x.node, out)
    return _wrap(Op.PERMUTE, (dims,), (x.node,), out)


def _reshape(tracer, func, args, kwargs):
    x = args[0]
    out = _run_shadow(func, args, kwargs)
    if tuple(out.shape) == tuple(x.shape):
        return LazyWeight(x.node, out)
    return _wrap(Op.RESHAPE, (tuple(out.shape),), (x.node,), out)


def _expand(tracer, func, args, kwargs):
    x = args[0]
    out = _run_shadow(func, args, kwargs)
    if tuple(out.shape) == tuple(x.shape):
        return LazyWeight(x.node, out)
    return _wrap(Op.EXPAND, (tuple(out.shape),), (x.node,), out)


def _identity_view(tracer, func, args, kwargs):
    return LazyWeight(args[0].node, _run_shadow(func, args, kwargs))


def _clone(tracer, func, args, kwargs):
    x = args[0]
    return _wrap(Op.CONTIGUOUS, (), (x.node,), _run_shadow(func, args, kwargs))


def _to_copy(tracer, func, args, kwargs):
    x = args[0]
    shadow_kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "pin_memory", "non_blocking")}
    out = _run_shadow(func, args, shadow_kwargs)
    if out.dtype == x.dtype:
        return _wrap(Op.CONTIGUOUS, (), (x.node,), out)
    return _wrap(Op.CAST, (dtype_name(out.dtype),), (x.node,), out)


def _elementwise(step: str):
    """A handler recording an elementwise step (runtime/casts.py:ELEMENTWISE) that the sender applies while staging."""
    def handler(tracer, func, args, kwargs):
        return _wrap(Op.MAP, (step,), (args[0].node,), _run_shadow(func, args, kwargs))

    return handler


def _scale_in_place(tracer, func, args, kwargs):
    """`x *= factor` with a Python number (vLLM folds a LoRA's scaling into lora_b so): x's chain gains a scale step.

    The proxy is re-pointed in place, as the real tensor would be changed in place; views taken of it
    earlier keep the unscaled chain, which is why only a plain number factor on a base proxy is accepted.
    """
    x, factor = args[0], args[1]
    if isinstance(factor, torch.Tensor):
        if isinstance(factor, LazyWeight) or factor.dim() != 0 or factor.device.type == "meta":
            raise UnsupportedOpError(str(func), _arg_types(args, kwargs), tracer.loading)
        factor = factor.item()
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise UnsupportedOpError(str(func), _arg_types(args, kwargs), tracer.loading)
    x.node = Node(Op.MAP, (scale_step(factor),), (x.node,), x.node.shape, x.node.dtype)
    return x


def _cat(tracer, func, args, kwargs):
    tensors = args[0]
    if not all(isinstance(t, LazyWeight) for t in tensors):
        raise UnsupportedOpError(str(func), "cat of LazyWeight with a real tensor", tracer.loading)
    out = _run_shadow(func, args, kwargs)
    dim = _norm_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), out.dim())
    result = dtype_name(out.dtype)
    # cat promotes mixed dtypes; record the promotion as an explicit cast of each promoted part.
    parts = tuple(
        t.node if t.node.dtype == result else Node(Op.CAST, (result,), (t.node,), t.node.shape, result)
        for t in tensors
    )
    return _wrap(Op.CAT, (dim,), parts, out)


def _copy(tracer, func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, LazyWeight):
        raise UnsupportedOpError(str(func), "copy_ into a LazyWeight (the trainer side is read-only)", tracer.loading)
    tracer.record_copy(dst, src)
    return dst


_HANDLERS = {
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.split.Tensor: _pieces,
    aten.split_with_sizes.default: _pieces,
    aten.unbind.int: _pieces,
    aten.permute.default: _permute,
    aten.transpose.int: _permute,
    aten.t.default: _permute,
    aten.view.default: _reshape,
    aten._unsafe_view.default: _reshape,
    aten.reshape.default: _reshape,
    aten.squeeze.default: _reshape,
    aten.squeeze.dim: _reshape,
    aten.squeeze.dims: _reshape,
    aten.unsqueeze.default: _reshape,
    aten.expand.default: _expand,
    aten.alias.default: _identity_view,
    aten.detach.default: _identity_view,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.exp.default: _elementwise("exp"),
    aten.neg.default: _elementwise("neg"),
    aten.mul_.Tensor: _scale_in_place,
    aten.mul_.Scalar: _scale_in_place,
    aten.cat.default: _cat,
    aten.copy_.default: _copy,
}

_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.item.default,
    aten.equal.default,
}


class WriteRecorder:
    """Records the writes into destination parameters while vLLM code runs on LazyWeights (a trace): copies as
    assignments, constant writes as fills; maps meta storages to parameter names."""

    def __init__(self, destinations: dict[str, torch.Tensor], *, only_fills: bool = False):
        """`only_fills`: record constant writes (fill_, zero_, copy_ of a known constant) and let every other write
        through (a post-load step, whose other writes are computed values such as the quantization, not transfers)."""
        self.only_fills = only_fills
        self.loading = "<none>"
        self.assignments: list[Assignment] = []
        self._by_storage: dict[int, tuple[str, torch.Tensor]] = {}
        self._copied: dict[str, list[Geometry]] = {}  # regions copies wrote, per destination: a later fill must miss them
        for name, param in destinations.items():
            key = param.untyped_storage()._cdata
            if key in self._by_storage:
                other = self._by_storage[key][0]
                raise DestinationError(f"parameters {other!r} and {name!r} share storage; tied parameters are not supported yet")
            self._by_storage[key] = (name, param)

    def record_copy(self, dst: torch.Tensor, src) -> None:
        if not isinstance(src, LazyWeight):
            raise UnsupportedOpError("aten.copy_.default", "copy_ of a real tensor into a traced parameter", self.loading)
        try:
            name, param = self._by_storage[dst.untyped_storage()._cdata]
        except KeyError:
            raise DestinationError(
                f"loading {self.loading!r}: copy_ into a tensor that is not a model parameter "
                f"(shape {tuple(dst.shape)}); only parameters can be planned destinations"
            ) from None
        if dst.dtype != param.dtype:
            raise DestinationError(f"loading {self.loading!r}: copy_ into {name!r} through a dtype-reinterpreting view")
        if tuple(src.shape) != tuple(dst.shape):
            # copy_ broadcasts its source: make that explicit so the chain stays elementwise.
            torch.broadcast_shapes(tuple(src.shape), tuple(dst.shape))
            src_node = src.node
            if src.dim() < dst.dim():
                padded = (1,) * (dst.dim() - src.dim()) + tuple(src.shape)
                src_node = Node(Op.RESHAPE, (padded,), (src_node,), padded, src_node.dtype)
            src_node = Node(Op.EXPAND, (tuple(dst.shape),), (src_node,), tuple(dst.shape), src_node.dtype)
        else:
            src_node = src.node
        if src_node.dtype != dtype_name(dst.dtype):
            src_node = Node(Op.CAST, (dtype_name(dst.dtype),), (src_node,), src_node.shape, dtype_name(dst.dtype))
        geometry = Geometry(dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
        self._copied.setdefault(name, []).append(geometry)
        self.assignments.append(Assignment(name, geometry, src_node, self.loading))

    def destination(self, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """(name, parameter) whose storage `tensor` views, or None for a tensor that is not a planned destination."""
        if isinstance(tensor, LazyWeight) or not isinstance(tensor, torch.Tensor):
            return None
        return self._by_storage.get(tensor.untyped_storage()._cdata)

    def record_constant(self, op: str, dst: torch.Tensor, value) -> None:
        """A constant written into a destination: `value` (a Python scalar) into every element of `dst`."""
        name, param = self.destination(dst)
        if dst.numel() == 0:  # e.g. fill_(0) of the padding rows of a shard that has none
            return
        if dst.dtype != param.dtype:
            raise DestinationError(f"loading {self.loading!r}: {op} into {name!r} through a dtype-reinterpreting view")
        if isinstance(value, float) and not np.isfinite(value):
            raise ConstantWriteError(op, name, f"writes the non-finite constant {value}", self.loading)
        geometry = Geometry(dst.storage_offset(), tuple(dst.shape), tuple(dst.stride()))
        starts, ends = geometry.intervals()
        for copied in self._copied.get(name, ()):
            c_starts, c_ends = copied.intervals()
            lo = np.searchsorted(c_ends, starts, side="right")  # first copied stretch ending after each fill start
            hit = (lo < len(c_starts)) & (c_starts[np.minimum(lo, len(c_starts) - 1)] < ends)
            if hit.any():
                raise ConstantWriteError(op, name, "overwrites elements a copy from the trainer's tensors wrote "
                                         "(a constant must come before the copies it overlaps)", self.loading)
        node = Node(Op.CONSTANT, (value, op), (), tuple(dst.shape), dtype_name(dst.dtype))
        self.assignments.append(Assignment(name, geometry, node, self.loading))

    def on_write(self, func, args, kwargs) -> None:
        """An in-place op on plain tensors: record it if it writes a constant into a destination, refuse any other."""
        kind = _WRITES[func]
        if self.only_fills and kind == "other":
            return
        if kind == "copy":
            dst, src = args[0], args[1]
            if isinstance(src, LazyWeight) or self.destination(dst) is None:
                return  # a traced copy (LazyWeight dispatch records it) or a loader's scratch tensor
            if self.only_fills and getattr(src, _CONSTANT_ATTR, None) is None:
                return
            self.record_constant("copy_", dst, _constant_value(self, dst, src))
        elif kind == "fill":
            dst = args[0]
            if self.destination(dst) is not None:
                value = args[1] if len(args) > 1 else 0
                self.record_constant(str(func.overloadpacket.__name__), dst, _constant_value(self, dst, value))
        else:
            for tensor in _written(func, args, kwargs):
                hit = self.destination(tensor)
                if hit is not None:
                    raise ConstantWriteError(str(func), hit[0], "is an in-place write the tracer has no rule for",
                                             self.loading)


def _constant_value(tracer: WriteRecorder, dst: torch.Tensor, value):
    """The Python scalar a fill_/copy_ writes everywhere: a number, or a real tensor holding one value."""
    if isinstance(value, (bool, int, float)):
        return value
    known = getattr(value, _CONSTANT_ATTR, None)
    if known is not None:
        return known
    name = tracer.destination(dst)[0]
    if isinstance(value, torch.Tensor) and value.device.type != "meta" and value.numel() > 0:
        flat = value.reshape(-1)
        if bool((flat == flat[0]).all()):
            return flat[0].item()
        raise ConstantWriteError("copy_", name, "copies a real tensor whose elements differ (not a constant)", tracer.loading)
    raise ConstantWriteError("copy_", name, f"copies a {type(value).__name__} with no readable value "
                             f"({getattr(value, 'device', '')}): a value vLLM computed, not a constant", tracer.loading)


# In-place ops on plain tensors, by what the tracer does with them: "copy" and "fill" are constant
# writes when their target is a destination; "other" (any other op that writes an argument) is refused there.
_CONSTANT_OPS = {aten.copy_.default: "copy", aten.fill_.Scalar: "fill", aten.fill_.Tensor: "fill", aten.zero_.default: "fill"}


# Tensors holding one known value everywhere, created while tracing (e.g. `param[i:j] = 0` makes a meta
# scalar_tensor and expands it) carry that value in this attribute; the ops below create or keep it.
_CONSTANT_ATTR = "_weightplan_constant"
_CONSTANT_MAKERS = {aten.scalar_tensor.default: lambda args, kwargs: args[0],
                    aten.full.default: lambda args, kwargs: args[1],
                    aten.zeros.default: lambda args, kwargs: 0,
                    aten.ones.default: lambda args, kwargs: 1}
_CONSTANT_KEEPERS = {aten.view.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.reshape.default,
                     aten._to_copy.default, aten.clone.default, aten.lift_fresh.default, aten.lift_fresh_copy.default,
                     aten.alias.default, aten.detach.default, aten.unsqueeze.default, aten.squeeze.dim, aten.permute.default,
                     aten.t.default, aten.transpose.int}


def _tag_constant(func, args, kwargs, out) -> None:
    if func in _CONSTANT_MAKERS:
        value = _CONSTANT_MAKERS[func](args, kwargs)
    elif func in _CONSTANT_KEEPERS and isinstance(args[0], torch.Tensor) and not isinstance(args[0], LazyWeight):
        value = getattr(args[0], _CONSTANT_ATTR, None)
    else:
        return
    if value is not None and isinstance(out, torch.Tensor) and not isinstance(out, LazyWeight):
        # the value as the output's dtype holds it (a cast rounds it as copy_ would)
        setattr(out, _CONSTANT_ATTR, torch.tensor(value).to(out.dtype).item())


class _WriteTable(dict):
    def __missing__(self, func):
        mutable = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
        kind = self[func] = _CONSTANT_OPS.get(func, "other" if mutable else None)
        return kind


_WRITES = _WriteTable()


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments `func` writes in place (its schema's mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out.extend(v for v in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(v, torch.Tensor))
    return out


class _ConstantWrites(TorchDispatchMode):
    """Sees every aten op while a trace runs, so in-place writes into (plain, meta) parameters reach the tracer."""

    def __init__(self, tracer: WriteRecorder):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _WRITES[func] is not None:
            self.tracer.on_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _CONSTANT_MAKERS or func in _CONSTANT_KEEPERS:
            _tag_constant(func, args, kwargs, out)
        return out


_state = threading.local()


def _current() -> WriteRecorder:
    tracer = getattr(_state, "tracer", None)
    if tracer is None:
        raise RuntimeError("LazyWeight used outside of an active weightplan trace")
    return tracer


@contextlib.contextmanager
def tracing(tracer: WriteRecorder):
    """Make `tracer` receive the ops of every LazyWeight used inside the block, and every in-place write into a destination."""
    previous = getattr(_state, "tracer", None)
    _state.tracer = tracer
    try:
        with _ConstantWrites(tracer):
            yield tracer
    finally:
        _state.tracer = previous
