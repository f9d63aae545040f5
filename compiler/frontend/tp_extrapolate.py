"""Derive a TP rank's traced load from its stage's first two: every integer in it moves by one fixed step per TP rank.

vLLM slices a tensor for TP rank r at offsets linear in r (`ColumnParallelLinear`, `RowParallelLinear`,
`MergedColumnParallelLinear`, `VocabParallelEmbedding` when the vocabulary divides evenly, the TP
slice of every routed expert). So the traced loads of ranks 0 and 1 differ only in integers, and
rank r's is rank 0's with each integer moved r times its step from 0 to 1. Anything else that
differs between the two (a name, a dtype, a float, the number of assignments) makes the load
not derivable (`NotAffine`). The caller guards every use: the last TP rank is also traced for real
and must equal its derivation (rank_models.py), as a reused layer is checked against a guard layer.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from typing import Any


class NotAffine(Exception):
    """The two traced loads differ in something other than integers (names the first difference)."""


def extrapolate(first: Any, second: Any, steps: int) -> Any:
    """`first` with every integer leaf `i` replaced by `i + steps * (j - i)`, `j` being `second`'s leaf at the same place.

    Walks frozen dataclasses, lists and tuples; every other leaf (str, float, bool, enum, None,
    frozenset) must be equal in both. Objects met twice as the same pair are derived once, so a
    node shared by several assignments stays shared; what does not move is `first`'s own object.
    """
    memo: dict[tuple[int, int], Any] = {}

    def walk(a, b):
        if a is b:  # the same object in both loads (a shared name, a small int): it moves by zero steps
            return a
        kind = type(a)
        if kind is not type(b):
            raise NotAffine(f"{kind.__name__} against {type(b).__name__}")
        if kind is int:
            return a + steps * (b - a)
        key = (id(a), id(b))
        out = memo.get(key)
        if out is not None:
            return out
        if kind is tuple or kind is list:
            if len(a) != len(b):
                raise NotAffine(f"{len(a)} items against {len(b)}")
            items = [walk(x, y) for x, y in zip(a, b)]
            out = a if all(z is x for z, x in zip(items, a)) else kind(items)
        elif kind in _FIELDS or dataclasses.is_dataclass(kind):
            changed = {}
            for name in _field_names(kind):
                x = getattr(a, name)
                z = walk(x, getattr(b, name))
                if z is not x:
                    changed[name] = z
            out = _with(a, changed) if changed else a
        elif issubclass(kind, numbers.Integral) and kind is not bool:
            out = kind(a + steps * (b - a))
        elif a == b and (kind in (str, float, bool, frozenset) or a is None or isinstance(a, enum.Enum)):
            out = a
        else:
            raise NotAffine(f"{a!r} against {b!r}"[:200])
        memo[key] = out
        return out

    return walk(first, second)


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    names = _FIELDS.get(kind)
    if names is None:
        fields = dataclasses.fields(kind)
        if hasattr(kind, "__post_init__") or any(not f.init for f in fields) or hasattr(kind, "__slots__"):
            raise NotAffine(f"{kind.__name__} computes fields of its own; its copies cannot be derived field by field")
        names = _FIELDS[kind] = tuple(f.name for f in fields)
    return names


def _with(value, changed: dict):
    """A copy of frozen dataclass `value` with `changed` fields (dataclasses.replace without re-running __init__:
    `_field_names` admits only classes whose __init__ just stores its fields, and this runs about 10^5 times a rank)."""
    out = object.__new__(type(value))
    out.__dict__.update(value.__dict__)
    out.__dict__.update(changed)
    return out
