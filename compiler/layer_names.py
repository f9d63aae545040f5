"""Decoder layer tensor names (`...layers.<index>.<rest>`): parse them and rename the layer index."""

from __future__ import annotations

import re

LAYER = re.compile(r"^(?P<head>.*?\.layers\.)(?P<index>\d+)\.(?P<tail>.+)$")


def layer_of(name: str) -> int | None:
    match = LAYER.match(name)
    return int(match["index"]) if match else None


def layer_tail(name: str) -> tuple[int, tuple[str, str]] | None:
    """(layer index, (name before the index, name past it)) of a decoder layer's tensor, or None."""
    match = LAYER.match(name)
    return (int(match["index"]), (match["head"], match["tail"])) if match else None


def rename(name: str, old: int, new: int) -> str:
    match = LAYER.match(name)
    if match is None or int(match["index"]) != old:
        return name
    return f"{match['head']}{new}.{match['tail']}"
