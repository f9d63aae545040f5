"""vLLM weight-transfer backend `weightplan`: the only run-time code that imports vLLM."""

BACKEND = "weightplan"

__all__ = ["BACKEND"]
