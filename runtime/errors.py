"""Errors shared by the compiler and the runtime; the CLI prints them without a traceback."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (pydantic and others span several), or its type's name when it has none
    (a MemoryError), at most 400 characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 400 else text[:397] + "..."


class WeightplanError(Exception):
    """Base class of every error weightplan reports to users."""


class PlanFormatError(WeightplanError):
    """A plan file is truncated, corrupted, of an unknown kind or of a newer format version."""


class PlanMismatchError(WeightplanError):
    """A plan does not match what it is run against (vLLM version, config, tensors, ranks)."""


class SyncError(WeightplanError):
    """A weight sync failed or timed out; the receiver's weights are marked incomplete."""


class LayoutError(WeightplanError):
    """A trainer layout (a --trainer-layout file or a live model's DTensors) is malformed or does not fit the trainer."""
