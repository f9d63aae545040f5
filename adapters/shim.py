"""What an adapter's `install()` replaces in a framework's code: checked by source hash first, put back by `uninstall()`."""

from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from collections.abc import Callable
from importlib import import_module
from typing import Any


def resolve(target: str) -> Any:
    """The object a `module:qualname` target names (its module imported)."""
    module_name, _, qualname = target.partition(":")
    obj = import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class Shim:
    """One framework's shim. `hashes`: target -> SHA-256 of the source the adapter was read against; `refusal(target)`:
    the one-line error for a target whose source differs. `originals` holds what is replaced while installed."""

    def __init__(self, package: str, hashes: dict[str, str], refusal: Callable[[str], Exception]):
        self.package, self.hashes, self.refusal = package, hashes, refusal
        self.lock = threading.Lock()
        self.originals: dict[str, Any] = {}  # target -> the framework's own object, while installed
        self._replaced: list[tuple[Any, str, Any]] = []  # (owner: module, class or dict; name or key; the old value)

    @property
    def installed(self) -> bool:
        return bool(self.originals)

    def checked(self, targets) -> dict[str, Any]:
        """Each target's object, after checking its source against `hashes` (refusal, and nothing changed, if one differs)."""
        found = {target: resolve(target) for target in targets}
        for target, obj in found.items():
            if hashlib.sha256(inspect.getsource(obj).encode()).hexdigest() != self.hashes[target]:
                raise self.refusal(target)
        return found

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set `owner`'s attribute (or, for a dict, its key) `name` to `value`, remembering the old value."""
        if isinstance(owner, dict):
            self._replaced.append((owner, name, owner[name]))
            owner[name] = value
        else:
            self._replaced.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    def rebind(self, original: Any, wrapper: Any) -> None:
        """`wrapper` under `original`'s name in every loaded module of the framework's package that holds `original`
        (its own module and every module that imported the name)."""
        name = original.__name__
        for module_name, module in list(sys.modules.items()):
            if module is None or not (module_name == self.package or module_name.startswith(f"{self.package}.")):
                continue
            if getattr(module, name, None) is original:
                self.replace(module, name, wrapper)

    def uninstall(self) -> None:
        """Put back everything replaced, last first."""
        with self.lock:
            while self._replaced:
                owner, name, value = self._replaced.pop()
                if isinstance(owner, dict):
                    owner[name] = value
                else:
                    setattr(owner, name, value)
            self.originals.clear()
