"""Derive a traced load from two others of its kind (TP ranks 0 and 1, experts 0 and 1): every integer moves by one fixed step.

vLLM slices a tensor for TP rank r at offsets linear in r (`ColumnParallelLinear`, `RowParallelLinear`,
`MergedColumnParallelLinear`, `VocabParallelEmbedding` when the vocabulary divides evenly, the TP
slice of every routed expert), and loads a layer's i-th local routed expert at offsets linear in i
(its slot in `w13_weight`/`w2_weight`, its index in a stacked trainer tensor, the number in its
checkpoint name). So two such loads differ only in integers, and the k-th one is the first with
each integer moved k times its step from the first to the second. Anything else that differs (a
name other than in its numbers, a dtype, a float, the number of assignments) makes the load not
derivable (`NotAffine`). Every caller guards its use: the last of the kind is also traced for real
and must equal its derivation (rank_models.py, expert_templates.py), as a reused layer is checked
against a guard layer.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import re
from typing import Any


class NotAffine(Exception):
    """The two traced loads differ in something other than integers (names the first difference)."""


def extrapolate(first: Any, second: Any, steps: int) -> Any:
    """`first` with every integer leaf `i` replaced by `i + steps * (j - i)`, `j` being `second`'s leaf at the same place.

    Walks frozen dataclasses, lists and tuples; strings may differ only in their decimal numbers,
    which move as integers do (`experts.3.` -> `experts.5.` -> `experts.7.`); every other leaf
    (float, bool, enum, None, frozenset) must be equal in both. Objects met twice as the same pair
    are derived once, so a node shared by several assignments stays shared; what does not move is
    `first`'s own object.
    """
    return Line(first, second)(steps)


class Line:
    """The loads through `first` (step 0) and `second` (step 1): `line(k)` is the k-th, as `extrapolate` describes.

    The two are compared once; each call rebuilds only the objects holding something that moves.
    """

    def __init__(self, first: Any, second: Any):
        self._memo: dict[tuple[int, int], Any] = {}
        self._plan = self._compare(first, second)
        del self._memo

    def __call__(self, steps: int) -> Any:
        built: dict[int, Any] = {}

        def build(plan):
            if not isinstance(plan, _Moves):
                return plan
            out = built.get(id(plan))
            if out is None:
                out = built[id(plan)] = plan.build(steps, build)
            return out

        return build(self._plan)

    def _compare(self, a, b):
        """`a` itself where nothing moves, else a `_Moves` that builds the k-th object."""
        if a is b:  # the same object in both loads (a shared name, a small int): it moves by zero steps
            return a
        kind = type(a)
        if kind is not type(b):
            raise NotAffine(f"{kind.__name__} against {type(b).__name__}")
        if kind is int:
            return a if a == b else _Int(kind, a, b - a)
        key = (id(a), id(b))
        out = self._memo.get(key)
        if out is not None:
            return out
        if kind is tuple or kind is list:
            if len(a) != len(b):
                raise NotAffine(f"{len(a)} items against {len(b)}")
            items = [self._compare(x, y) for x, y in zip(a, b)]
            out = _Items(kind, items) if any(isinstance(z, _Moves) for z in items) else a
        elif kind in _FIELDS or dataclasses.is_dataclass(kind):
            moves = {}
            for name in _field_names(kind):
                z = self._compare(getattr(a, name), getattr(b, name))
                if isinstance(z, _Moves):
                    moves[name] = z
            out = _Fields(a, moves) if moves else a
        elif kind is str:
            out = _text(a, b)
        elif issubclass(kind, numbers.Integral) and kind is not bool:
            out = a if a == b else _Int(kind, a, b - a)
        elif a == b and (kind in (float, bool, frozenset) or a is None or isinstance(a, enum.Enum)):
            out = a
        else:
            raise NotAffine(f"{a!r} against {b!r}"[:200])
        self._memo[key] = out
        return out


class _Moves:
    """Part of a `Line` that differs from step to step."""

    def build(self, steps: int, build):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, eq=False)
class _Int(_Moves):
    kind: type
    start: int
    step: int

    def build(self, steps, build):
        return self.kind(self.start + steps * self.step)


@dataclasses.dataclass(frozen=True, eq=False)
class _Items(_Moves):
    kind: type
    items: list

    def build(self, steps, build):
        return self.kind([build(item) for item in self.items])


@dataclasses.dataclass(frozen=True, eq=False)
class _Fields(_Moves):
    """A frozen dataclass copied with its moving fields rebuilt, without re-running __init__ (`_field_names` admits only
    classes whose __init__ just stores its fields, and a GLM-5.2 rank builds about 10^5 of them)."""

    base: Any  # the object at step 0
    moves: dict

    def build(self, steps, build):
        out = object.__new__(type(self.base))
        out.__dict__.update(self.base.__dict__)
        out.__dict__.update({name: build(plan) for name, plan in self.moves.items()})
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class _Text(_Moves):
    parts: list  # text between numbers, and the numbers as _Int or str

    def build(self, steps, build):
        out = []
        for part in self.parts:
            if isinstance(part, _Int):
                moved = part.start + steps * part.step
                if moved < 0:
                    raise NotAffine(f"a number in a name would be {moved} at step {steps}")
                out.append(str(moved))
            else:
                out.append(part)
        return "".join(out)


_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    names = _FIELDS.get(kind)
    if names is None:
        fields = dataclasses.fields(kind)
        if hasattr(kind, "__post_init__") or any(not f.init for f in fields) or hasattr(kind, "__slots__"):
            raise NotAffine(f"{kind.__name__} computes fields of its own; its copies cannot be derived field by field")
        names = _FIELDS[kind] = tuple(f.name for f in fields)
    return names


_NUMBER = re.compile(r"(\d+)")


def _text(a: str, b: str):
    """`a` if equal, else a `_Text` moving each decimal number that differs; the text around the numbers must be equal."""
    if a == b:
        return a
    parts, others = _NUMBER.split(a), _NUMBER.split(b)
    if len(parts) != len(others):
        raise NotAffine(f"{a!r} against {b!r}"[:200])
    out: list = []
    for k, (x, y) in enumerate(zip(parts, others)):
        if x == y:
            out.append(x)
        elif k % 2 == 0 or any(len(n) > 1 and n[0] == "0" for n in (x, y)):  # other text, or a zero-padded number
            raise NotAffine(f"{a!r} against {b!r}"[:200])
        else:
            out.append(_Int(int, int(x), int(y) - int(x)))
    return _Text(out)
