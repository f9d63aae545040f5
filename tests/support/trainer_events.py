"""The JSON event lines a trainer process of the engine tests prints (testing/engine_trainer.py), waited for."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path


def trainer_event(tmp: Path, key: str, proc: subprocess.Popen, kind: str, version: int | None = None,
                  timeout: float = 180) -> dict:
    """The first event `kind` (of `version`, if given) in `tmp/<key>.out`; AssertionError with the process's stderr
    if it exits first or none comes within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (tmp / f"{key}.out").read_text().splitlines():
            e = json.loads(line) if line.startswith("{") else {}
            if e.get("event") == kind and version in (None, e.get("version")):
                return e
        if proc.poll() is not None:
            raise AssertionError(f"{key} exited before {kind}: {(tmp / f'{key}.err').read_text()[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{key}: no {kind} v{version}: {(tmp / f'{key}.err').read_text()[-3000:]}")
