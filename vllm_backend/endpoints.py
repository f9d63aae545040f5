"""Starting and closing a runtime endpoint (Sender or Receiver) on runtimes that separate those steps."""

from __future__ import annotations


def close_endpoint(endpoint) -> None:
    """Call `endpoint.close()`, else its NIXL agent's `close()`, if this runtime version has them (None is a no-op)."""
    for obj in (endpoint, getattr(endpoint, "agent", None)):
        close = getattr(obj, "close", None)
        if callable(close):
            close()
            return


def start_endpoint(endpoint) -> None:
    """Call `endpoint.start()` (register and publish) if this runtime version separates it from construction."""
    start = getattr(endpoint, "start", None)
    if callable(start):
        start()
