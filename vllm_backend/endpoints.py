"""Closing a runtime endpoint (Sender or Receiver) through `close()`, on runtimes that have it."""

from __future__ import annotations


def close_endpoint(endpoint) -> None:
    """Call `endpoint.close()`, else its NIXL agent's `close()`, if this runtime version has them (None is a no-op)."""
    for obj in (endpoint, getattr(endpoint, "agent", None)):
        close = getattr(obj, "close", None)
        if callable(close):
            close()
            return
