"""Which UCX transports a process used, read from the protocol tables UCX prints with UCX_PROTO_INFO=y."""

from __future__ import annotations

import re

# UCX (1.16+) prints one table per protocol selection when UCX_PROTO_INFO=y and UCX_LOG_LEVEL=info, each line behind
# a "[time] [host:pid :thread]" prefix:
#   +--------+-------------+-------------------------------------------+
#   | <worker name> intra-node cfg#1                                    |
#   | remote memory read by ucp_get*(multi) into cuda memory from cuda  |
#   +--------+-------------+-------------------------------------------+
#   | Range  | Description |                  Config                   |
#   +--------+-------------+-------------------------------------------+
#   | 0..inf | zero-copy   | cuda_ipc/cuda                             |
#   +--------+-------------+-------------------------------------------+
# A Config cell names transports as tl/device ("tcp/lo", "cma/memory", "50% on cuda_ipc/cuda"), wrapping onto
# continuation rows whose Range is empty.
_ROW = re.compile(r"^\s*(?:\[[^\]]*\]\s*){0,2}\s*([|+].*?)\s*$")
_TRANSPORT = re.compile(r"(?<![\w/])([a-z][a-z0-9_]*)/([A-Za-z0-9_.:\-]+)")
# The runtime's payload moves as NIXL READs (ucp_get); the rest are control messages and the put table UCX prints
# for NIXL's loopback check when an agent starts.
READ = "remote memory read"


def tables(text: str) -> list[dict]:
    """Every protocol table in `text`: {"endpoint", "operation", "rows": [(range, description, config)],
    "transports": sorted tl/device names}, in the order printed. Lines that are not table lines are ignored."""
    found, table, state = [], None, None
    for line in text.splitlines():
        m = _ROW.match(line)
        if not m:
            continue
        cells = m.group(1)
        if cells.startswith("+"):
            if table is None:
                table, state = {"endpoint": "", "operation": "", "rows": [], "transports": []}, "title"
            elif state == "title":
                state = "head"
            elif state == "head":
                state = "body"
            else:
                _close(table, found)
                table, state = None, None
            continue
        if table is None:
            continue
        parts = [c.strip() for c in cells.strip("|").split("|")]
        if state == "title":
            if not table["endpoint"]:
                table["endpoint"] = parts[0]
            else:
                table["operation"] = (table["operation"] + " " + parts[0]).strip()
        elif state == "body" and len(parts) >= 3:
            rng, description, config = parts[0], parts[1], "|".join(parts[2:])
            if not rng and table["rows"]:  # a continuation of the previous row's cells
                r0, d0, c0 = table["rows"][-1]
                table["rows"][-1] = (r0, f"{d0} {description}".strip(), f"{c0} {config}".strip())
            else:
                table["rows"].append((rng, description, config))
    if table is not None and state == "body":
        _close(table, found)
    return found


def _close(table: dict, found: list[dict]) -> None:
    names = {f"{tl}/{dev}" for _, _, config in table["rows"] for tl, dev in _TRANSPORT.findall(config)}
    table["transports"] = sorted(names)
    if table["operation"]:
        found.append(table)


def transports(text: str) -> dict:
    """What `text` (one or more processes' UCX output) says moved bytes: {"read": transport names (tl, without the
    device) of the READ tables, "read_detail": their tl/device names, "by_operation": {operation: tl/device names}}."""
    by_operation: dict[str, set[str]] = {}
    for table in tables(text):
        by_operation.setdefault(table["operation"], set()).update(table["transports"])
    read = sorted({t for op, names in by_operation.items() if op.startswith(READ) for t in names})
    return {"read": sorted({t.split("/")[0] for t in read}), "read_detail": read,
            "by_operation": {op: sorted(names) for op, names in sorted(by_operation.items())}}
