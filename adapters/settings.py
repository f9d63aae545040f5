"""What every RL framework adapter's settings share: the plan, the rendezvous store and the sync options."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass
class PublishSettings:
    """`plan`: a compiled plan, or None to compile one from the live model. `address`: the rendezvous store trainer
    rank 0 hosts (port 0: a free one). `job`: the job id (each adapter defaults to its framework's name). `timeout`,
    `verify`, `delta`: as the vLLM backend's (docs/vllm.md). `workdir`: where the trainer layout and the compiled plan go
    (default a temporary directory; inference processes on other hosts need it shared)."""

    plan: str | None = None
    address: str = "127.0.0.1:0"
    job: str = "weightplan"
    timeout: float = 120.0
    verify: bool = False
    delta: float = 0.0
    workdir: str | None = None

    @classmethod
    def from_json(cls, text: str, source: str):
        """Settings from a JSON object of their fields (`source` names where it came from in the errors); anything else
        is refused in one line naming it."""
        try:
            given = json.loads(text)
        except ValueError:
            given = None
        if not isinstance(given, dict):
            raise ValueError(f"{source} is not a JSON object of {cls.__name__} fields: {text[:80]!r}")
        defaults = {f.name: f.default for f in fields(cls)}
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ValueError(f"{source} names {', '.join(unknown)}, which {cls.__name__} does not have")
        wrong = sorted(k for k, v in given.items() if not _same_kind(v, defaults[k]))
        if wrong:
            raise ValueError(f"{source}: {', '.join(f'{k}={given[k]!r}' for k in wrong)} has the wrong type")
        return cls(**given)


def _same_kind(value, default) -> bool:
    """Whether a JSON value fits a settings field whose default is `default` (None: an optional path)."""
    if default is None:
        return value is None or isinstance(value, str)
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))
