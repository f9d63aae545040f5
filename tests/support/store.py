"""Test helpers that order threads by the rendezvous store rather than by sleeps."""

from __future__ import annotations

import time


def wait_for_key(rendezvous, key: str, seconds: float = 10.0) -> None:
    """Return once `key` exists in the store; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not rendezvous.exists(key):
        assert time.monotonic() < deadline, f"{key} not written within {seconds} s"
        time.sleep(0.01)
