"""Write a file atomically: a unique temporary file in the same directory, fsynced, renamed over the target."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, data: bytes, error: type[Exception], what: str) -> Path:
    """Write `data` to `path` so a reader sees the old file or the new one, never part of one.

    Concurrent writers of one path each rename a whole file; a failure leaves no temporary file
    behind and raises `error` naming `what` and the path in one line.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise error(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise error(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    return path
