"""Typed errors raised while building and tracing a model; each says what, where and what to do."""

from weightplan.runtime.errors import WeightplanError

from ..errors import ModelConfigError  # re-exported: the frontend modules import it from here


class TraceError(WeightplanError):
    """The loader did something the tracer cannot represent as a transfer plan."""


class UnsupportedOpError(TraceError):
    def __init__(self, op: str, arg_types: str, loading: str):
        self.op, self.arg_types, self.loading = op, arg_types, loading
        super().__init__(
            f"unsupported op {op} with arguments {arg_types} while loading checkpoint tensor {loading!r}; "
            "the tracer records view/slice/cast/cat/copy ops only. Add a rule to "
            "compiler/frontend/lazy_weight.py if this op is a pure data movement."
        )


class DataDependentError(TraceError):
    def __init__(self, call: str, loading: str):
        self.call, self.loading = call, loading
        super().__init__(
            f"data-dependent call {call} on a LazyWeight while loading checkpoint tensor {loading!r}: "
            "a plan cannot depend on weight values. The loader reads values; it cannot be compiled."
        )


class ConstantWriteError(TraceError):
    def __init__(self, op: str, parameter: str, what: str, loading: str):
        self.op, self.parameter, self.loading = op, parameter, loading
        super().__init__(
            f"{op} into parameter {parameter!r} while loading checkpoint tensor {loading!r} {what}; a plan moves "
            "trainer bytes and writes constants, it cannot compute on loaded values (e.g. Mamba's A = -exp(A_log)). "
            "If this write is a constant, add a rule to compiler/frontend/lazy_weight.py."
        )


class DestinationError(TraceError):
    """A copy_ wrote somewhere that is not a planned destination parameter."""


class UnloadedParameterError(TraceError):
    """A parameter no checkpoint tensor reaches, which vLLM's own loader would refuse to leave unwritten."""
