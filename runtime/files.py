"""The files users name (plans, layouts, cluster files, configs): read as regular files of bounded size, JSON in one-line errors; written atomically."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from pathlib import Path

MAX_JSON_BYTES = 256 << 20  # a layout, cluster or config file
MAX_PLAN_BYTES = 4 << 30


def read_regular_file(path: str | Path, limit: int, error: type[Exception], what: str) -> bytes:
    """The bytes of `path`, refusing (`error`, one line naming `what` and the path) anything that is not a regular file
    (a FIFO would block, /dev/zero never ends) or holds more than `limit` bytes; never reads more than limit + 1."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise error(f"{what} {path} is not a regular file")
            if info.st_size > limit:
                raise error(f"{what} {path} has {info.st_size} bytes, more than the {limit} this reads")
            data = file.read(limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise error(f"{what} {path} grew past the {limit} bytes this reads while it was read")
    return data


def parse_json(data: bytes, error: type[Exception], what: str, **loads_kwargs):
    """JSON from UTF-8 `data`; non-UTF-8 text, bad syntax, nesting deeper than Python recurses or an integer of more
    digits than Python converts become one `error` line naming `what`."""
    try:
        return json.loads(data.decode("utf-8"), **loads_kwargs)
    except UnicodeDecodeError as exc:
        raise error(f"{what} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise error(f"{what} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than sys.get_int_max_str_digits() digits
        raise error(f"{what} is not valid JSON: {str(exc).splitlines()[0][:120]}") from None


def read_json_file(path: str | Path, error: type[Exception], what: str, limit: int = MAX_JSON_BYTES, **loads_kwargs):
    """read_regular_file, then parse_json."""
    return parse_json(read_regular_file(path, limit, error, what), error, f"{what} {path}", **loads_kwargs)


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
