"""The error compiler.models and the frontend share: a model name or config that cannot be resolved or built."""

from weightplan.runtime.errors import WeightplanError


class ModelConfigError(WeightplanError):
    """The model name or config cannot be resolved or built by vLLM."""
